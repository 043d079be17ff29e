"""Experiment: cache-write launch configs (tokens per program x warps) for a 4096-token prompt.

    python -m benchmarks.experiments.write_sweep

B=4096 new tokens, 8 KV heads, D=128, bf16 input, page 16, the prompt's pages
scattered over the pool (as benchmarks.run's write records). Prints ms and the
fraction of copy bandwidth (bytes read + written) per config and scheme; the
template's default_config is marked. First, for scale, a plain device copy of
the same number of bytes (half read, half written): what a kernel this small
can reach at all. fp8 runs with the hardware conversion and without it.
Every time is bench_cold's (a CUDA graph of writes over 8 input sets, cold in
L2): do_bench times the Python launch of a kernel this short.
"""

import sys

from benchmarks import run as bench_run
from benchmarks import run_other_ops

PAGE, Hkv, D, N = 16, 8, 128, 4096


def main() -> int:
    copy_bw = bench_run.copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    for name in ("int8", "fp8", "bf16"):
        mod, scheme = bench_run.kernel_module("cache_write", name, Hkv, 8, D)
        cases = [run_other_ops.write_case(scheme, N, Hkv, D) for _ in range(run_other_ops.WRITE_COPIES)]
        nbytes = cases[0][4]
        ms = run_other_ops.plain_copy_ms(nbytes)
        print(f"{name:5} plain copy of the same bytes  {ms:.4f} ms  bw {nbytes / (ms * 1e-3) / copy_bw:.3f}", flush=True)
        default = mod.default_config(N)
        for tpp in (2, 4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                for native in ((1, 0) if name == "fp8" else (1,)):
                    cfg = {"tokens_per_program": tpp, "num_warps": warps}
                    mark = "  <- default" if cfg == default else ""
                    if name == "fp8":
                        cfg["native_fp8"] = native
                    ms = bench_run.bench_cold([lambda c=c: mod.launch(*c[:4], config=cfg) for c in cases])
                    print(f"{name:5} {cfg}  {ms:.4f} ms  bw {nbytes / (ms * 1e-3) / copy_bw:.3f}{mark}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
