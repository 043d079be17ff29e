"""Launch one scheme's decode kernel a few times at B=32, L=4096, 64/8, D=128 for ncu.

KVGEN_PROFILE_SHAPE="B,L,Hq,Hkv,D" picks another shape (ncu passes the environment on).

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 -m benchmarks.experiments.profile_decode int8 [pages_per_tile] [warps] [stages] [splits]
"""

import math
import os
import sys

import torch

from benchmarks import run as bench_run


def main():
    name = sys.argv[1]
    ppt, warps, stages, splits = (int(x) for x in (sys.argv[2:6] + ["8", "4", "2", "1"][len(sys.argv[2:6]):]))
    B, L, Hq, Hkv, D = (int(x) for x in os.environ.get("KVGEN_PROFILE_SHAPE", "32,4096,64,8,128").split(","))
    mod, scheme = bench_run.kernel_module("decode", name, Hkv, Hq // Hkv, D)
    case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
    out = torch.empty_like(case.q)
    cfg = {"pages_per_tile": ppt, "num_warps": warps, "num_stages": stages, "num_splits": splits}
    for _ in range(3):
        mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, 1 / math.sqrt(D), cfg)
    torch.cuda.synchronize()
    print(name, cfg, "ms", bench_run.bench(lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens,
                                                                case.num_compressed, 1 / math.sqrt(D), cfg), rep_ms=50))


if __name__ == "__main__":
    main()
