"""CUDA vs Triton decode through generated packages, and contiguous SDPA, at the ANCHORS shapes.

    python -m benchmarks.cuda_decode --out cuda_decode.json [--schemes bf16,int8,int4] [--quick] [--tune]

For each shape (B, L, Hq/Hkv, D; page 16) and scheme it compiles a one-layer
plan twice (``--backend triton`` and ``--backend cuda``), loads each package,
fills every sequence with the same random K/V (one seed), plans one decode
step and times ``cache.decode`` (``triton.testing.do_bench``, median) with
the runtime's own config choice (the model; ``--tune`` also times the tuned
winner). SDPA is ``scaled_dot_product_attention`` over contiguous bf16 K/V
of the same shape (``enable_gqa``). Each record holds the times, the
configs, the KV bytes read and the fraction of the measured copy bandwidth,
and ``rel_l2_cuda_vs_triton`` (the two backends on identical data). Records
are written to ``--out`` after each case; a table is printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time

from benchmarks.run import ANCHOR_SHAPES as ANCHORS
from benchmarks.run import PAGE, copy_bandwidth
from kvgen.atomic import write_atomic



def anchor_plan(scheme, B, L, Hq, Hkv, D):
    """The plan the harnesses compile: a one-layer model of Hq/Hkv heads of D, B sequences of L tokens, H200."""
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    model = dataclasses.replace(resolve_model("llama-3-8b"), name=f"anchor-{Hq}-{Hkv}-d{D}", num_layers=1,
                                num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, hidden_size=Hq * D,
                                max_positions=max(L, 8192))
    return make_plan(model, resolve_target("h200"), Workload(context=L, concurrency=B, page_size=PAGE),
                     default_registry().schemes, kv=scheme)


def _compile(scheme, backend, B, L, Hq, Hkv, D, out_dir):
    from kvgen.codegen.package import compile_plan
    from kvgen.integrations.transformers import import_package

    plan = anchor_plan(scheme, B, L, Hq, Hkv, D)
    t0 = time.perf_counter()
    res = compile_plan(plan, os.path.join(out_dir, f"{scheme}-{backend}-{B}x{L}-{Hq}-{Hkv}-{D}"), backend=backend)
    return import_package(res.out_dir), time.perf_counter() - t0, res


def cache_tokens(B: int, L: int) -> int:
    """The ``max_tokens`` a harness cache of B sequences of L tokens loads with: their pages, room for a few more
    tokens each, and a residual scheme's append slack. ``pool_sizes`` takes the residual pool (tails plus
    APPEND_SLACK_PAGES) out of the same budget, so without the slack int2 ran out of compressed pages below about
    22 sequences (8 x 32768: 53 pages short)."""
    from kvgen.runtime.page_pool import APPEND_SLACK_PAGES

    return B * L + 4 * PAGE * B + APPEND_SLACK_PAGES * PAGE


def filled_cache(pkg, shape, seed, tune_dir):
    """A one-layer cache of ``pkg`` on the GPU holding B sequences of L tokens of random K/V (one seed), a
    decode step planned; returns ``(cache, q, autotune module)``. Its autotuner is in ``cached`` mode with
    its files under ``tune_dir``."""
    import torch

    B, L, Hq, Hkv, D = shape
    rt = importlib.import_module(pkg.__name__ + ".runtime.autotune")
    tuner = rt.Autotuner(torch.device("cuda"), mode="cached", directory=tune_dir, progress=False)
    cache = pkg.load(device="cuda", max_tokens=cache_tokens(B, L), num_layers=1, max_seqs=B, autotuner=tuner)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = list(range(B))
    for i in ids:
        cache.add(i)
    cache.plan_step(ids, L - 1)
    kv = lambda n: torch.randn(n, Hkv, D, device="cuda", dtype=cache.dtype, generator=gen)  # noqa: E731
    cache.append_kv(0, None, kv(B * (L - 1)), kv(B * (L - 1)))
    q = torch.randn(B, Hq, D, device="cuda", dtype=cache.dtype, generator=gen)
    k1, v1 = kv(B), kv(B)
    cache.plan_step(ids, 1)
    cache.append_kv(0, None, k1, v1)
    return cache, q, rt


def _run_package(pkg, shape, seed, tune, tmp, label):
    import torch
    from triton.testing import do_bench

    B, L = shape[:2]
    cache, q, rt = filled_cache(pkg, shape, seed, os.path.join(tmp, f"tune-{label}"))
    out = cache.decode(0, q, None)
    torch.cuda.synchronize()
    rec = {"config": cache.step.configs.get("decode"),
           "ms": float(do_bench(lambda: cache.decode(0, q, None, out=out), warmup=25, rep=200))}
    if tune:
        t0 = time.perf_counter()
        recs = rt.tune(cache, [(B, L)], ops=("decode",))
        rec["tune_s"] = time.perf_counter() - t0
        rec["tuned_config"] = recs[0]["config"]
        rec["tuned_ms"] = float(do_bench(cache._bench("decode", (B, L), recs[0]["config"], exact=True), warmup=25, rep=200))
    result = out.float().clone()
    del cache
    torch.cuda.empty_cache()
    return rec, result


def _sdpa_ms(shape):
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    B, L, Hq, Hkv, D = shape
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ms = float(do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), warmup=25, rep=200))
    del q, k, v
    torch.cuda.empty_cache()
    return ms


def case(scheme, shape, args, tmp, copy_bw):
    B, L, Hq, Hkv, D = shape
    rec = {"scheme": scheme, "B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D}
    outs = {}
    for backend in ("triton", "cuda"):
        pkg, secs, res = _compile(scheme, backend, B, L, Hq, Hkv, D, tmp)
        rec[f"{backend}_compile_s"] = round(secs, 2)
        if backend == "cuda":
            rec["cuda_notes"] = res.notes
            if pkg.KERNELS["decode"].__dict__.get("BACKEND") != "cuda":
                rec["cuda_error"] = "decode has no CUDA kernel for this plan"
                break
        t0 = time.perf_counter()
        r, outs[backend] = _run_package(pkg, shape, args.seed, args.tune, tmp, f"{scheme}-{backend}-{B}x{L}")
        rec[f"{backend}_first_run_s"] = round(time.perf_counter() - t0, 2)
        rec.update({f"{backend}_{k}": v for k, v in r.items()})
    if "cuda" in outs:
        a, b = outs["cuda"], outs["triton"]
        rec["rel_l2_cuda_vs_triton"] = float((a - b).norm() / b.norm())
    from kvgen.registry import default_registry

    # the scheme's own accounting (residual schemes: the partial tail page counts as compressed, a rounding)
    kv_bytes = int(B * L * Hkv * default_registry().schemes[scheme].bytes_per_token_per_kv_head(D, PAGE))
    rec["kv_bytes"] = kv_bytes
    for backend in ("triton", "cuda"):
        for key in ("ms", "tuned_ms"):
            ms = rec.get(f"{backend}_{key}")
            if ms:
                rec[f"{backend}_{key}_bw"] = round(kv_bytes / (ms * 1e-3) / copy_bw, 3)
    return rec


def _table(records):
    cols = ["scheme", "B", "L", "Hq", "Hkv", "D", "sdpa_ms", "triton_ms", "cuda_ms", "cuda/triton", "cuda/sdpa",
            "cuda_bw", "rel_l2"]
    rows = []
    for r in records:
        t, c, s = r.get("triton_tuned_ms") or r.get("triton_ms"), r.get("cuda_tuned_ms") or r.get("cuda_ms"), r.get("sdpa_ms")
        rows.append([r["scheme"], r["B"], r["L"], r["Hq"], r["Hkv"], r["D"], _f(s), _f(t), _f(c),
                     _f(c / t if c and t else None), _f(c / s if c and s else None),
                     _f(r.get("cuda_tuned_ms_bw") or r.get("cuda_ms_bw")), _f(r.get("rel_l2_cuda_vs_triton"), 4)])
    widths = [max(len(str(x)) for x in [c] + [row[i] for row in rows]) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols)] + [line(r) for r in rows])


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file the records are written to")
    ap.add_argument("--schemes", default="bf16,int8")
    ap.add_argument("--quick", action="store_true", help="the first ANCHORS shape only")
    ap.add_argument("--tune", action="store_true", help="also time each backend's tuned winner (kvgen tune's path)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("KVGEN_CACHE_DIR", tempfile.mkdtemp(prefix="kvgen-cuda-bench-"))
    copy_bw = copy_bandwidth()
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bw_Bps": copy_bw}
    records = []
    shapes = ANCHORS[:1] if args.quick else ANCHORS
    with tempfile.TemporaryDirectory(prefix="kvgen-cuda-bench-pkgs-") as tmp:
        for shape in shapes:
            sdpa = _sdpa_ms(shape)
            for scheme in args.schemes.split(","):
                try:
                    rec = case(scheme, shape, args, tmp, copy_bw)
                except Exception as exc:  # keep measuring the other cases; the record says what failed
                    rec = {"scheme": scheme, "B": shape[0], "L": shape[1], "Hq": shape[2], "Hkv": shape[3],
                           "D": shape[4], "error": f"{type(exc).__name__}: {exc}"}
                rec["sdpa_ms"] = sdpa
                records.append(rec)
                print(json.dumps(rec), flush=True)
                write_atomic(args.out, json.dumps({"meta": meta, "records": records}, indent=1))
    print(_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
