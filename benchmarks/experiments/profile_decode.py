"""Launch one scheme's decode kernel a few times at B=32, L=4096, 64/8, D=128 for ncu.

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 -m benchmarks.experiments.profile_decode int8 [pages_per_tile] [warps] [stages] [splits]
"""

import math
import sys

import torch

from benchmarks import run as bench_run


def main():
    name = sys.argv[1]
    ppt, warps, stages, splits = (int(x) for x in (sys.argv[2:6] + ["8", "4", "2", "1"][len(sys.argv[2:6]):]))
    mod, scheme = bench_run.kernel_module("decode", name, 8, 8, 128)
    case = bench_run.DecodeCase(scheme, 32, 4096, 64, 8, 128)
    out = torch.empty_like(case.q)
    cfg = {"pages_per_tile": ppt, "num_warps": warps, "num_stages": stages, "num_splits": splits}
    for _ in range(3):
        mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, 1 / math.sqrt(128), cfg)
    torch.cuda.synchronize()
    print(name, cfg, "ms", bench_run.bench(lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens,
                                                                case.num_compressed, 1 / math.sqrt(128), cfg), rep_ms=50))


if __name__ == "__main__":
    main()
