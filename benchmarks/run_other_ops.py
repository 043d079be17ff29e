"""``benchmarks.run``'s records of the ops beside decode: cache writes, paged prefill, ``kvgen compile``.

Each ``*_records(..., log)`` logs and returns its records in the table's
format (``benchmarks.run.table``); ``benchmarks.run`` calls them by ``--ops``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.run import PAGE, DecodeCase, bench, bench_cold, best_config, kernel_module


def write_case(scheme, N, Hkv, D, *, prompt=True, device="cuda"):
    """N new tokens' K/V (bf16, random) and the pool a cache write stores them in.

    ``prompt``: consecutive slots of the prompt's own pages, the pages scattered
    over the pool; otherwise one token per sequence anywhere in the pool (a
    decode step). Residual schemes write the bf16 residual pool. Returns
    ``(k, v, pools, slots, bytes)``, bytes = K/V read + pool bytes written + slot ids.
    """
    from kvgen.runtime.pools import allocate_pool

    pages = max(64, 4 * N // PAGE)
    if scheme.residual_tokens is None:
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in scheme.page_tensors(D, PAGE)]
    else:
        tensors = [{"name": "rk", "dtype": "compute", "shape": [PAGE, D]},
                   {"name": "rv", "dtype": "compute", "shape": [PAGE, D]}]
    pools = allocate_pool(tensors, pages, Hkv, torch.bfloat16, device)
    k = torch.randn(N, Hkv, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if prompt:
        own = torch.randperm(pages, device=device)[: N // PAGE]
        slots = (own[:, None] * PAGE + torch.arange(PAGE, device=device)[None, :]).flatten().long()
    else:
        slots = torch.randperm(pages * PAGE, device=device)[:N].long()
    written = sum(pools[t["name"]][0].numel() * pools[t["name"]].element_size() for t in tensors) / PAGE * N
    return k, v, pools, slots, int(2 * k.numel() * k.element_size() + written + slots.numel() * 8)


WRITE_COPIES = 8
"""Independent input sets a write is timed over (bench_cold): 8 x ~30 MB at 4096 tokens, past the L2 cache."""


def plain_copy_ms(nbytes: int) -> float:
    """bench_cold of a device copy moving ``nbytes`` (half read, half written) over WRITE_COPIES buffer pairs:
    what a kernel of that size reaches at all."""
    copies = [(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"),
               torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")) for _ in range(WRITE_COPIES)]
    return bench_cold([lambda d=d, s=s: d.copy_(s) for d, s in copies])


def write_records(schemes, copy_bw, log):
    """Cache write (quantize + scatter) of one decode step (32 tokens) and of a 4096-token prefill.

    Timed with bench_cold (a CUDA graph of writes on rotating inputs); beside each, a plain
    device copy of the same number of bytes timed the same way (``copy_ms``): what a kernel
    this small reaches at all (the 4 GiB copy that defines copy_bw amortizes its ramp-up
    and tail, a 25 MB one does not).
    """
    records = []
    Hkv, D = 8, 128
    for name in schemes:
        mod, scheme = kernel_module("cache_write", name, Hkv, 8, D)
        for N, label in ((32, "decode step"), (4096, "prefill 4096")):
            cases = [write_case(scheme, N, Hkv, D, prompt=N != 32) for _ in range(WRITE_COPIES)]
            nbytes = cases[0][4]
            ms = bench_cold([lambda c=c: mod.launch(*c[:4]) for c in cases])
            copy_ms = plain_copy_ms(nbytes)
            copy_fraction = nbytes / (copy_ms * 1e-3) / copy_bw
            rec = dict(op="write", scheme=name, B=N, L=1, Hq=64, Hkv=Hkv, D=D, page_size=PAGE, ms=ms, bytes=nbytes,
                       bw_fraction=nbytes / (ms * 1e-3) / copy_bw, sdpa_ms=None, rel_error=None,
                       config=mod.default_config(N), copy_ms=copy_ms,
                       copy_fraction=copy_fraction, note=f"{label}; a plain copy of as many bytes: {copy_fraction:.3f}")
            log(rec)
            records.append(rec)
            del cases
            torch.cuda.empty_cache()
    return records


def prefill_records(schemes, copy_bw, log):
    """Causal prefill of B=4 prompts of 8192 tokens vs SDPA (flash) on contiguous tensors.

    "pages": every key read through the block table from the scheme's pages (a chunk
    whose K/V are already cached, e.g. after a prefix-cache hit). "fresh" (bf16 only):
    the prompt's own K/V passed as k_new/v_new, as KVCache.prefill(layer, q, k, v) runs a
    new prompt; there is no cached prefix, so no page is read.
    """
    records = []
    B, L, Hq, Hkv, D = 4, 8192, 64, 8, 128
    variants = [(name, "pages") for name in schemes] + ([("bf16", "fresh")] if "bf16" in schemes else [])
    for name, kv in variants:
        mod, scheme = kernel_module("prefill", name, Hkv, Hq // Hkv, D)
        case = DecodeCase(scheme, B, L, Hq, Hkv, D)
        q = torch.randn(B * L, Hq, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
        flops = 4 * B * Hq * D * L * L / 2
        fresh = {}
        if kv == "fresh":
            fresh = {"k_new": case.k_raw.transpose(1, 2).reshape(B * L, Hkv, D),
                     "v_new": case.v_raw.transpose(1, 2).reshape(B * L, Hkv, D)}

        def run(cfg):
            mod.launch(q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, cu, L, 1 / math.sqrt(D),
                       cfg, **fresh)

        ms, cfg, _ = best_config(mod, run, B, L)
        qs = q.view(B, L, Hq, D).transpose(1, 2)
        f = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms = bench(lambda: f(qs, case.k_raw, case.v_raw, is_causal=True, enable_gqa=True))
        rec = dict(op="prefill", scheme=name, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE, ms=ms, bytes=case.bytes,
                   bw_fraction=None, sdpa_ms=sdpa_ms, tflops=flops / (ms * 1e-3) / 1e12,
                   ratio_to_sdpa_throughput=sdpa_ms / ms, rel_error=None, config=cfg, note=f"kv from {kv}")
        log(rec)
        records.append(rec)
        del case
        torch.cuda.empty_cache()
    return records


def compile_records(log):
    from kvgen.codegen.package import compile_plan
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    records = []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        plan = make_plan(resolve_model("llama-3-70b"), resolve_target("h100"), Workload(), default_registry().schemes, kv="int4")
        cold = compile_plan(plan, Path(d) / plan.name)
        cold_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = make_plan(resolve_model("llama-3-70b"), resolve_target("h100"), Workload(), default_registry().schemes, kv="int4")
        warm = compile_plan(plan, Path(d) / plan.name)
        warm_s = time.perf_counter() - t1
        assert warm.unchanged
    for label, s in (("cold", cold_s), ("cached", warm_s)):
        rec = dict(op="compile", scheme="int4", B=None, L=None, Hq=64, Hkv=8, D=128, page_size=16, ms=s * 1e3,
                   bytes=None, bw_fraction=None, sdpa_ms=None, rel_error=None, note=label)
        log(rec)
        records.append(rec)
    return records
