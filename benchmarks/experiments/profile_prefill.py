"""Launch one scheme's prefill kernel a few times at B=4, L=8192, 64/8, D=128 (benchmarks.run's prefill shape) for ncu.

    ncu --kernel-name regex:_prefill_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight ... \
        python3 -m benchmarks.experiments.profile_prefill int8 [pages_per_tile] [warps] [stages] [block_m]

Every key comes from the pages (no k_new/v_new), as the "kv from pages" rows of benchmarks.run.
"""

import math
import sys

import torch

from benchmarks import run as bench_run


def main():
    name = sys.argv[1]
    ppt, warps, stages, block_m = (int(x) for x in (sys.argv[2:6] + ["2", "4", "2", "8"][len(sys.argv[2:6]):]))
    B, L, Hq, Hkv, D = 4, 8192, 64, 8, 128
    mod, scheme = bench_run.kernel_module("prefill", name, Hkv, Hq // Hkv, D)
    case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
    q = torch.randn(B * L, Hq, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
    cfg = {"block_m": block_m, "pages_per_tile": ppt, "num_warps": warps, "num_stages": stages}

    def run():
        mod.launch(q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, cu, L, 1 / math.sqrt(D), cfg)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ms = bench_run.bench(run, rep_ms=100)
    print(name, cfg, "ms", ms, "TFLOP/s", 4 * B * Hq * D * L * L / 2 / (ms * 1e-3) / 1e12)


if __name__ == "__main__":
    main()
