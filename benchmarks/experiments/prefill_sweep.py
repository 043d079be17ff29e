"""Experiment: prefill launch configs at benchmarks.run's prefill shape (B=4, L=8192, 64/8, D=128, every key from pages).

    python -m benchmarks.experiments.prefill_sweep [--schemes bf16,int8,int4] [--seconds 200]

For each scheme and config: bf16 reads its pages in place; quantized schemes are
timed staged (staged=1: one pass dequantizes every page into a bf16 buffer, the
attention reads that) and, for the template's default, in place. The staging
pass alone is timed too, so the attention's share of a staged launch is known.
SDPA (flash, contiguous) is timed in the same process; ratios are SDPA time /
config time (throughput relative to SDPA). Configs go beyond the template's
candidates (128-token KV tiles, 3-4 stages), which is the point: which of them
should be candidates. Stops starting new configs after --seconds.
"""

import argparse
import math
import sys
import time

import torch

from benchmarks import run as bench_run

B, L, Hq, Hkv, D = 4, 8192, 64, 8, 128


def configs():
    """Tile rows (query tokens x 8 heads) x KV tile tokens x stages, the likeliest first."""
    grid = [(128, 8, kv, st) for kv in (64, 128, 32) for st in (2, 3, 4)] + \
           [(64, 4, kv, st) for kv in (64, 128) for st in (2, 3)]
    for rows, warps, kv, stages in grid:
        yield {"block_m": rows // (Hq // Hkv), "pages_per_tile": kv // bench_run.PAGE, "num_warps": warps,
               "num_stages": stages}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--seconds", type=float, default=200)
    args = ap.parse_args()
    t_end = time.perf_counter() + args.seconds
    q = torch.randn(B * L, Hq, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
    flops = 4 * B * Hq * D * L * L / 2
    sdpa_ms = None
    for name in args.schemes.split(","):
        mod, scheme = bench_run.kernel_module("prefill", name, Hkv, Hq // Hkv, D)
        case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
        if sdpa_ms is None:
            qs = q.view(B, L, Hq, D).transpose(1, 2)
            f = torch.nn.functional.scaled_dot_product_attention
            sdpa_ms = bench_run.bench(lambda: f(qs, case.k_raw, case.v_raw, is_causal=True, enable_gqa=True))
            print(f"sdpa {sdpa_ms:.3f} ms  {flops / (sdpa_ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)

        def run(cfg):
            mod.launch(q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, cu, L,
                       1 / math.sqrt(D), cfg)

        if mod.STAGEABLE:
            max_pages = case.block_tables.shape[1]
            sk = torch.empty(B * max_pages, Hkv, bench_run.PAGE, D, dtype=q.dtype, device="cuda")
            sv = torch.empty_like(sk)
            every_seq = torch.arange(B, dtype=torch.int32, device="cuda")  # staging slot b holds sequence b
            stage = lambda: mod._stage_kernel[(max_pages, B, Hkv)](  # noqa: E731
                *[case.pools[n] for n in mod.POOL_TENSORS], case.block_tables, case.seq_lens, case.num_compressed,
                cu, every_seq, sk, sv, case.block_tables.stride(0), max_pages, FRESH=False)
            ms = bench_run.bench(stage)
            print(f"{name:5} staging pass alone  {ms:.3f} ms", flush=True)
            del sk, sv
            default = mod.in_place_config(mod.default_config(B, L, L, "cuda"))
            ms = bench_run.bench(lambda: run(default), rep_ms=100)
            print(f"{name:5} in place {default}  {ms:.3f} ms  x{sdpa_ms / ms:.3f} SDPA", flush=True)
        for cfg in configs():
            if time.perf_counter() > t_end:
                print("out of time", flush=True)
                break
            cfg = dict(cfg, staged=1) if mod.STAGEABLE else cfg
            try:
                ms = bench_run.bench(lambda: run(cfg), rep_ms=60)
            except Exception as exc:  # registers / shared memory: the config does not compile
                print(f"{name:5} {cfg}  failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            print(f"{name:5} {cfg}  {ms:.3f} ms  x{sdpa_ms / ms:.3f} SDPA", flush=True)
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
