"""The first step of a new shape bucket: what it costs over a tuned step, and what tuning one bucket costs.

    python -m benchmarks.first_step --out first_step.json [--schemes bf16,int8,int4] [--cold-triton]
    TRITON_INTERPRET=1 python -m benchmarks.first_step --smoke --out /tmp/first_step.json   # CPU check

For each ANCHORS shape and scheme it compiles a one-layer plan, loads it with
an empty autotune cache (a fresh KVGEN_CACHE_DIR) in the default mode (no
timing on the request path), fills every sequence to just under the context
and measures, wall clock with a device synchronize:

- ``warmup_s``: the load-time kernel warm-up (``runtime/warmup.py``, what
  ``load()`` runs by default), timed apart from ``load_s``, with
  ``warmup_scenarios`` run (``--no-warmup`` skips it, as before it existed);
- ``first_step_s``: the first ``plan_step`` + ``append_kv`` + ``decode`` of the
  bucket after the warm-up (config lookup, any Triton compile left, the run),
  and ``first_step_compiles`` the kernels Triton had to build or load then;
- ``steady_step_s``: the same step again with the model's config (median of 3);
- ``tune_s``: ``autotune.tune`` of the decode bucket ahead of time (what
  ``kvgen tune`` runs), with ``tune_candidates`` timed; ``prefill_tune_s``
  likewise for a prefill bucket of ``min(L, 2048)``-token chunks;
- ``tuned_step_s``: the step with the tuned winner; ``first_overhead_s`` =
  first - tuned (the issue's goal: <= 1 s), and kernel times ``model_ms`` /
  ``tuned_ms`` of the two configs (do_bench; the model's quality).

``--cold-triton`` points TRITON_CACHE_DIR at an empty folder first, so the
first step includes compiling its kernels from scratch. Records are written
to ``--out`` after each case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

ANCHORS = [  # (B, L, Hq, Hkv, D)
    (32, 4096, 64, 8, 128),
    (1, 131072, 64, 8, 128),
    (8, 32768, 64, 8, 128),
    (64, 2048, 32, 8, 128),
    (16, 8192, 32, 4, 64),
]
SMOKE = [(2, 64, 4, 2, 64), (1, 128, 4, 1, 64)]  # head_dim 64: every built-in scheme takes it
PAGE = 16
TAIL = 8  # decode steps the bucket must hold: fill to L - TAIL so every step stays in bucket L


def build(scheme: str, B: int, L: int, Hq: int, Hkv: int, D: int, dtype: str, out_dir: str):
    """Compile a one-layer plan for the shape and import its package: (package, compile seconds)."""
    from kvgen.codegen.package import compile_plan
    from kvgen.integrations.transformers import import_package
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    model = dataclasses.replace(resolve_model("llama-3-8b"), name=f"anchor-{Hq}-{Hkv}-d{D}", num_layers=1,
                                num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, hidden_size=Hq * D,
                                max_positions=max(L, 8192))
    plan = make_plan(model, resolve_target("h200"), Workload(context=L, concurrency=B, page_size=PAGE,
                                                             compute_dtype=dtype),
                     default_registry().schemes, kv=scheme)
    t0 = time.perf_counter()
    pkg = import_package(compile_plan(plan, os.path.join(out_dir, f"{scheme}-{B}x{L}-{Hq}-{Hkv}-{D}")).out_dir)
    return pkg, time.perf_counter() - t0


def case(scheme, shape, args, device, dtype_name, tmp):
    import torch

    B, L, Hq, Hkv, D = shape
    rec = {"scheme": scheme, "B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D}
    pkg, rec["compile_s"] = build(scheme, B, L, Hq, Hkv, D, dtype_name, tmp)
    rt = importlib.import_module(pkg.__name__ + ".runtime.autotune")
    timer = None if not args.smoke else (lambda fn: _wall_ms(fn, device))
    tuner = rt.Autotuner(device, mode="cached", directory=os.path.join(tmp, f"tune-{scheme}-{B}x{L}"),
                         timer=timer, progress=False)
    from benchmarks.cuda_decode import cache_tokens  # imports torch: only where a cache is loaded

    t0 = time.perf_counter()
    cache = pkg.load(device=device, max_tokens=cache_tokens(B, L), num_layers=1, max_seqs=B, autotuner=tuner,
                     warmup=False)
    rec["load_s"] = time.perf_counter() - t0
    if not args.no_warmup:  # what load() does by default, timed on its own
        wu = importlib.import_module(pkg.__name__ + ".runtime.warmup")
        t0 = time.perf_counter()
        report = wu.warm_up(cache, force=args.smoke)
        rec["warmup_s"] = time.perf_counter() - t0
        rec["warmup_scenarios"] = len(report.scenarios)
        rec["warmup_skipped"] = report.skipped
    dtype = cache.dtype
    ids = list(range(B))
    for i in ids:
        cache.add(i)
    fill = L - TAIL
    kv = lambda n: torch.randn(n, Hkv, D, device=device, dtype=dtype)  # noqa: E731
    t0 = time.perf_counter()
    cache.plan_step(ids, fill)
    rec["fill_plan_step_s"] = time.perf_counter() - t0
    cache.append_kv(0, None, kv(B * fill), kv(B * fill))
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    k1, v1 = kv(B), kv(B)

    def step():
        _sync(device)
        t = time.perf_counter()
        cache.plan_step(ids, 1)
        cache.append_kv(0, None, k1, v1)
        out = cache.decode(0, q, None)
        _sync(device)
        return time.perf_counter() - t, out

    with _compile_log() as compiled:
        rec["first_step_s"], out = step()
    rec["first_step_compiles"] = compiled  # kernels Triton built (or loaded from disk) during the first step
    rec["finite"] = bool(torch.isfinite(out).all())
    decode_mod = cache.kernels["decode"]
    shape_key = (B, L)
    rec["model_config"] = cache.step.configs.get("decode")
    rec["model_origin"] = tuner.origin("decode", decode_mod, shape_key, cache._hashes.get("decode"))
    rec["steady_step_s"] = statistics.median(step()[0] for _ in range(3))
    if args.smoke:
        tuner.force = True  # the CPU cannot time for real; force exercises the same path
    t0 = time.perf_counter()
    recs = rt.tune(cache, [shape_key], ops=("decode",))
    rec["tune_s"] = time.perf_counter() - t0
    rec["tune_candidates"] = recs[0]["candidates"]
    rec["tuned_config"] = recs[0]["config"]
    rec["tuned_step_s"] = statistics.median(step()[0] for _ in range(3))
    rec["first_overhead_s"] = rec["first_step_s"] - rec["tuned_step_s"]
    if not args.smoke:
        from triton.testing import do_bench
        for name, cfg in (("model_ms", rec["model_config"]), ("tuned_ms", rec["tuned_config"])):
            rec[name] = float(do_bench(cache._bench("decode", shape_key, cfg, exact=True), warmup=25, rep=100)) if cfg else None
        vars(cache).pop("_bench_inputs", None)
    if "prefill" in cache.kernels and not args.no_prefill:
        chunk = min(L, 2048 if not args.smoke else 32)
        t0 = time.perf_counter()
        precs = rt.tune(cache, [(B, L)], ops=("prefill",), prefill_tokens=chunk)
        rec["prefill_tune_s"] = time.perf_counter() - t0
        rec["prefill_tune_candidates"] = precs[0]["candidates"]
        rec["prefill_bucket"] = precs[0]["key"]
    del cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


class _compile_log:
    """Within the block, the list of kernels Triton's in-process cache missed (its ``jit_cache_hook``)."""

    def __enter__(self):
        self.names: list[str] = []
        try:
            from triton import knobs
        except ImportError:  # older Triton: nothing to hook, an empty log
            self.knobs = None
            return self.names
        self.knobs, self.old = knobs, knobs.runtime.jit_cache_hook

        def hook(*args, **kw):
            self.names.append(str(kw.get("repr", kw.get("fn", "?")))[:400])
            return False  # compile as usual

        knobs.runtime.jit_cache_hook = hook
        return self.names

    def __exit__(self, *exc):
        if self.knobs is not None:
            self.knobs.runtime.jit_cache_hook = self.old
        return False


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_ms(fn, device):
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--shapes", default=None, help="indices into ANCHORS, e.g. 0,2 (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (run with TRITON_INTERPRET=1)")
    ap.add_argument("--cold-triton", action="store_true", help="an empty TRITON_CACHE_DIR (compile from scratch)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill tuning measurement")
    ap.add_argument("--no-warmup", action="store_true", help="load without the kernel warm-up (as before it)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kvgen-first-step-")
    if args.cold_triton:
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    os.environ["KVGEN_CACHE_DIR"] = os.path.join(tmp, "cache")  # no tuned winner from earlier runs
    os.environ.pop("KVGEN_AUTOTUNE", None)
    import torch

    if args.smoke:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        device, dtype_name, shapes = torch.device("cpu"), "float32", SMOKE
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        device, dtype_name = torch.device("cuda", torch.cuda.current_device()), "bfloat16"
        shapes = ANCHORS if args.shapes is None else [ANCHORS[int(i)] for i in args.shapes.split(",")]
    import triton
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "sms": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1,
              "torch": torch.__version__, "triton": triton.__version__, "cold_triton": args.cold_triton,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python -m benchmarks.first_step", *sys.argv[1:]]),
              "records": []}
    for scheme in args.schemes.split(","):
        for shape in shapes:
            try:
                rec = case(scheme, shape, args, device, dtype_name, tmp)
            except Exception as err:  # keep measuring the other cases
                rec = {"scheme": scheme, "shape": list(shape), "error": f"{type(err).__name__}: {err}"[:500]}
            result["records"].append(rec)
            print(json.dumps(rec), flush=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    bad = [r for r in result["records"] if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
