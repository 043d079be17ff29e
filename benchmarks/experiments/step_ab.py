"""Experiment: what does each of the decode step's unmeasured changes buy? Same-process A/B of engine steps (GPU).

    python -m benchmarks.experiments.step_ab [--kv int4,bf16] [--shapes 32x2048] [--rounds 3]
        [--variants engine,norm_fused,write_kernel,prefetch64] [--steps 24] [--out step_ab.json]

The variants (``engine``, the engine as it runs, is the baseline):

- ``norm_fused``: ``gemv.FUSED_NORM`` on, so the residual add + RMSNorm
  runs in the small GEMMs (o and down add into the residual stream in their
  epilogue, q/k/v and gate/up normalize on the way in: 64 fewer launches a
  Llama-3-8B step) instead of as its own kernel between them. Off by default
  since it measured 0.12-0.16 ms a step slower (int4, B=32 at 2K, H200,
  2026-12-05, as the variant ``norm_kernel`` against the fused default then).
- ``write_kernel``: ``graphs.WRITE_THROUGH`` off, so the cache write
  kernel runs every layer instead of the kernel that applies RoPE (the q/k/v
  small GEMM's epilogue, or the RoPE kernel at batch 1-4) storing k and v
  into the pages (bf16 pages, int4's residual pages).
- ``prefetch<KiB>`` (e.g. ``prefetch64``): the projections' PDL launches
  (the GEMV's blocks, the small GEMM's programs) ask L2 for about that many
  KiB of their first weight bytes before they wait for the kernel before
  them (``pdl.PREFETCH_SWITCH``).

Per scheme and shape one engine (its projections chosen once, before any
variant); its decode graphs are captured again for each variant in turn,
``rounds`` times, alternating, because the context grows with every
measurement. A record: the variant, the round, the best of two timed runs of
``steps`` steps (ms a step) and the context then. The summary (printed, and
under ``summary`` in the JSON) fits ``engine``'s ms against the context of
its rounds (a line; flat with one round) and gives each other variant's ms
above that line at its own context, per round and on average: negative
means the variant is faster than the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import torch

from benchmarks.engine import filled_engine, log, parse_shape, release, timed_steps
from kvgen.atomic import write_atomic

WARMUP = 4


@contextlib.contextmanager
def variant(name: str):
    """Apply one variant (the module docstring's) for the ``with`` block; raise ValueError for an unknown name."""
    from kvgen.engine import gemv, pdl

    if name == "engine":
        yield
    elif name == "norm_fused":
        was, gemv.FUSED_NORM = gemv.FUSED_NORM, True
        try:
            yield
        finally:
            gemv.FUSED_NORM = was
    elif name == "write_kernel":
        from kvgen.engine import graphs

        was, graphs.WRITE_THROUGH = graphs.WRITE_THROUGH, False
        try:
            yield
        finally:
            graphs.WRITE_THROUGH = was
    elif name.startswith("prefetch") and name[len("prefetch"):].isdigit():
        old = os.environ.get(pdl.PREFETCH_SWITCH)
        os.environ[pdl.PREFETCH_SWITCH] = name[len("prefetch"):]
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(pdl.PREFETCH_SWITCH)
            else:
                os.environ[pdl.PREFETCH_SWITCH] = old
    else:
        raise ValueError(f"unknown variant {name!r}: engine, norm_fused, write_kernel or prefetch<KiB>")


def measure(kv: str, B: int, L: int, variants: list[str], rounds: int, steps: int) -> list[dict]:
    from kvgen.engine.graphs import DecodeGraphs

    per_variant = WARMUP + 2 * steps
    eng = filled_engine(kv, B, L, L + rounds * len(variants) * per_variant + 256, async_scheduling=True)
    records = []
    for rnd in range(rounds):
        for name in variants:
            with variant(name):
                eng.runner.graphs = None
                gc.collect()
                torch.cuda.empty_cache()
                eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, B, eng.max_model_len, verbose=False)
                for _ in range(WARMUP):
                    eng.step()
                ms = min(timed_steps(eng, steps) for _ in range(2))
            rec = {"kv": kv, "B": B, "context": L, "variant": name, "round": rnd, "ms": ms,
                   "context_now": eng.scheduler.running[0].num_computed}
            log(json.dumps(rec))
            records.append(rec)
    holder = [eng]
    del eng
    release(holder)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (kv, B, context) and variant other than ``engine``: its ms minus ``engine``'s at the same context, from
    a least-squares line through ``engine``'s (context_now, ms) records (its mean when they share one context);
    ``delta_ms`` per round in round order and ``mean_ms``. Groups without ``engine`` records are left out."""
    out = []
    for key in dict.fromkeys((r["kv"], r["B"], r["context"]) for r in records):
        group = [r for r in records if (r["kv"], r["B"], r["context"]) == key]
        base = [(r["context_now"], r["ms"]) for r in group if r["variant"] == "engine"]
        if not base:
            continue
        mx = sum(c for c, _ in base) / len(base)
        my = sum(m for _, m in base) / len(base)
        var = sum((c - mx) ** 2 for c, _ in base)
        slope = sum((c - mx) * (m - my) for c, m in base) / var if var else 0.0
        for name in dict.fromkeys(r["variant"] for r in group if r["variant"] != "engine"):
            rows = sorted((r for r in group if r["variant"] == name), key=lambda r: r["round"])
            deltas = [r["ms"] - (my + slope * (r["context_now"] - mx)) for r in rows]
            out.append({"kv": key[0], "B": key[1], "context": key[2], "variant": name, "delta_ms": deltas,
                        "mean_ms": sum(deltas) / len(deltas), "engine_ms_per_token": slope})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4,bf16")
    ap.add_argument("--shapes", default="32x2048")
    ap.add_argument("--variants", default="engine,norm_fused")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default="step_ab.json")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    for name in variants:  # an unknown name fails before an engine is built
        with variant(name):
            pass
    if not torch.cuda.is_available():
        print("step_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    records = [r for B, L in shapes for kv in a.kv.split(",")
               for r in measure(kv, B, L, variants, a.rounds, a.steps)]
    summary = summarize(records)
    for s in summary:
        log(f"{s['kv']} B={s['B']} L={s['context']} {s['variant']}: {s['mean_ms']:+.4f} ms a step against engine "
            f"(rounds {', '.join(f'{d:+.4f}' for d in s['delta_ms'])})")
    write_atomic(a.out, json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "records": records, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
