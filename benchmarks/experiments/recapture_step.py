"""Experiment: does capturing the decode graphs again, after prefill, change the engine's step time? (GPU)

    python -m benchmarks.experiments.recapture_step [--kv int4,bf16] [--shapes 1x16384] [--steps 64]
                                                    [--out recapture_step.json]

``benchmarks.engine`` times steps of the graphs captured at engine start;
``benchmarks.experiments.pdl_step`` captures them again after the prefill and
timed the same engine's steps about 4% faster (2026-12-03-nvidia-h200-6
against the fifth set, and again in the seventh set). Per scheme and shape,
one engine: ``STEP_WARMUP`` steps, then ``STEP_ROUNDS`` timed rounds of the
start graphs (as ``benchmarks.engine``); then twice in turn the graphs captured
again (``pdl_step.recapture``, the GEMV choice re-timed) and timed the same
way; then once more with the start graphs' GEMV choice restored (no
re-timing). Each record holds the rounds, the GEMV choices and the decode
config the graphs run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.engine import STEP_ROUNDS, STEP_WARMUP, filled_engine, log, parse_shape, release, step_rounds
from benchmarks.experiments.pdl_step import recapture
from kvgen.atomic import write_atomic


def describe(eng, B: int) -> dict:
    graphs = eng.runner.graphs
    pick = getattr(eng.cache, "kernel_config", None)
    cfg = pick("decode", (B, graphs.max_pages * eng.cache.page_size)) if pick else None
    return {"gemv": [c.describe() for c in graphs.gemv_choices], "decode_config": cfg}


def measure(kv: str, B: int, L: int, steps: int) -> dict:
    phases = 4
    max_len = L + phases * (STEP_WARMUP + STEP_ROUNDS * steps) + 64
    eng = filled_engine(kv, B, L, max_len, async_scheduling=True)
    out = {"kv": kv, "B": B, "context": L, "steps": steps, "phases": []}
    out["phases"].append({"graphs": "start", "ms": step_rounds(eng, steps), **describe(eng, B)})
    from kvgen.engine import gemv

    kept, kept_map = eng.runner.graphs.gemv_choices, dict(gemv._CHOICES)  # what the start graphs run
    for i in range(2):
        recapture(eng, B, max_len, "1")
        out["phases"].append({"graphs": f"recaptured {i + 1}", "ms": step_rounds(eng, steps), **describe(eng, B)})
    # the start graphs' GEMV choice restored: recapture without re-timing it
    real_choose = gemv.choose

    def restore(*a, **k):
        gemv.clear()
        gemv._CHOICES.update(kept_map)
        return kept
    gemv.choose = restore
    try:
        recapture(eng, B, max_len, "1")
    finally:
        gemv.choose = real_choose
    out["phases"].append({"graphs": "recaptured, start GEMV choice", "ms": step_rounds(eng, steps), **describe(eng, B)})
    for p in out["phases"]:
        log(f"kv={kv} B={B} L={L} {p['graphs']}: {' '.join(f'{x:.3f}' for x in p['ms'])} ms a step")
    holder = [eng]
    del eng
    release(holder)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4,bf16")
    ap.add_argument("--shapes", default="1x16384")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="recapture_step.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("recapture_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    records = [measure(kv, B, L, a.steps) for B, L in shapes for kv in a.kv.split(",")]
    write_atomic(a.out, json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "records": records}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
