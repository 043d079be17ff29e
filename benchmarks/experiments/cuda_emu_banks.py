"""Shared-memory bank conflicts of the CUDA decode's readers, counted on the CPU (tests/cuda_emu), no GPU needed.

    python -m benchmarks.experiments.cuda_emu_banks [int4:128:bfloat16 int8:64:float16 ...] [--tokens 1216]

One decode per case (``tests.kernels.test_cuda_decode.bank_stats``: one KV head, a GQA group of 8, page 16, 4 warps,
2 stages, one split) through the emulation, whose bank model (kvgen_emu_banks.h, ``account``) serves every
``lds_words`` the way the hardware does: a read of up to 4 bytes a lane in one pass of the warp, 8 bytes in two, 16
in four, and a pass takes as many wavefronts as its most-used bank has distinct words. Prints, for all reads and by width, the reads and wavefronts per pass (1.00:
conflict-free). ``--tokens`` sets the sequence length (1216: 76 whole tiles, no KIVI residual tail beyond int2's
last 128 tokens).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT = ["bf16:128:bfloat16", "fp8:128:bfloat16", "int8:128:bfloat16", "int4:128:bfloat16", "int2:128:bfloat16",
           "bf16:64:bfloat16", "fp8:64:float16", "int8:64:float16", "int4:64:float16", "int2:64:float16",
           "fp16:256:float16", "int4:256:bfloat16", "int2:256:bfloat16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=DEFAULT, help="scheme:head_dim:compute_dtype")
    ap.add_argument("--tokens", type=int, default=1216)
    args = ap.parse_args(argv)
    from tests.kernels.test_cuda_decode import bank_stats

    for case in args.cases:
        scheme, d, dtype = case.split(":")
        stats = bank_stats(scheme, int(d), dtype, args.tokens)
        parts = [f"{w}B {v['reads']} reads {v['wavefronts'] / v['ideal']:.2f}" for w, v in stats.items()
                 if v["reads"] and w != "all"]
        total = stats["all"]
        print(f"{scheme:5} D={d:>3}: {total['wavefronts'] / total['ideal']:.3f} wavefronts a pass over "
              f"{total['reads']} reads ({'; '.join(parts)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
