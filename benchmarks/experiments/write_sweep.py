"""Experiment: cache-write launch configs (tokens per program x warps) for a 4096-token prompt.

    python -m benchmarks.experiments.write_sweep

B=4096 new tokens, 8 KV heads, D=128, bf16 input, page 16, the prompt's pages
scattered over the pool (as benchmarks.run's write records). Prints ms and the
fraction of copy bandwidth (bytes read + written) per config and scheme; the
template's default_config is marked.
"""

import sys

import torch

from benchmarks import run as bench_run
from kvgen.runtime.pools import allocate_pool

PAGE, Hkv, D, N = 16, 8, 128, 4096


def main() -> int:
    copy_bw = bench_run.copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    for name in ("bf16", "int8", "fp8", "int4"):
        mod, scheme = bench_run.kernel_module("cache_write", name, Hkv, 8, D)
        if scheme.residual_tokens is None:
            tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in scheme.page_tensors(D, PAGE)]
        else:
            tensors = [{"name": "rk", "dtype": "compute", "shape": [PAGE, D]},
                       {"name": "rv", "dtype": "compute", "shape": [PAGE, D]}]
        pages = 4 * N // PAGE
        pools = allocate_pool(tensors, pages, Hkv, torch.bfloat16, "cuda")
        k = torch.randn(N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        own = torch.randperm(pages, device="cuda")[: N // PAGE]
        slots = (own[:, None] * PAGE + torch.arange(PAGE, device="cuda")[None, :]).flatten().long()
        written = sum(pools[t["name"]][0].numel() * pools[t["name"]].element_size() for t in tensors) / PAGE * N
        nbytes = 2 * k.numel() * k.element_size() + written + slots.numel() * 8
        default = mod.default_config(N)
        for tpp in (1, 2, 4, 8, 16):
            for warps in (1, 2, 4):
                cfg = {"tokens_per_program": tpp, "num_warps": warps}
                ms = bench_run.bench(lambda: mod.launch(k, v, pools, slots, config=cfg))
                mark = "  <- default" if cfg == default else ""
                print(f"{name:5} {cfg}  {ms:.4f} ms  bw {nbytes / (ms * 1e-3) / copy_bw:.3f}{mark}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
