"""Decode steps with and without programmatic dependent launch (kvgen/engine/pdl.py), on one engine (GPU).

    python -m benchmarks.experiments.pdl_step [--kv int4,bf16] [--shapes 1x16384,32x2048] [--steps 64]
                                              [--rounds 2] [--out pdl_step.json]

For each scheme and shape it builds the random-weight Llama-3-8B engine of
``benchmarks.engine``, fills B sequences to L tokens, and then, ``--rounds``
times in turn, captures the decode graphs again with ``KVGEN_PDL=0`` and with
``KVGEN_PDL=1`` (the GEMV choice is re-timed under each) and times ``--steps``
async-scheduled steps of each: the same engine, cache and sequences, so the
ratio is PDL's alone. Each record holds ms per step for both modes, the
roofline of ``benchmarks.engine`` and the ratio. Correctness is the GPU
tests' (``tests/engine/test_gpu.py``: PDL and plain launches give the same
tokens).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks.engine import filled_engine, log, parse_shape, release, timed_steps, weight_bytes
from benchmarks.run import copy_bandwidth
from kvgen.atomic import write_atomic


def recapture(eng, max_batch: int, max_model_len: int, mode: str) -> None:
    """The engine's decode graphs captured anew with ``KVGEN_PDL=mode`` (the old ones freed first), the projection
    kernels timed afresh: ``KVGEN_AUTOTUNE=off`` while they are chosen keeps the chooser from recalling what the
    engine's start remembered (the cache's own tuner, made at load, keeps its mode)."""
    from kvgen.engine.graphs import DecodeGraphs

    os.environ["KVGEN_PDL"] = mode
    eng.runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    before = os.environ.get("KVGEN_AUTOTUNE")
    os.environ["KVGEN_AUTOTUNE"] = "off"
    try:
        eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, max_batch, max_model_len, verbose=False)
    finally:
        if before is None:
            os.environ.pop("KVGEN_AUTOTUNE", None)
        else:
            os.environ["KVGEN_AUTOTUNE"] = before


def measure(kv: str, B: int, L: int, steps: int, rounds: int, bw: float) -> dict:
    max_len = L + (2 * rounds + 1) * (steps + 8) + 64
    eng = filled_engine(kv, B, L, max_len, async_scheduling=True)
    times: dict[str, list[float]] = {"0": [], "1": []}
    gemv_choices: dict[str, list[str]] = {}
    for _ in range(rounds):
        for mode in ("0", "1"):
            recapture(eng, B, max_len, mode)
            # the GEMV's own times (graphs of one projection after another) under this mode
            gemv_choices[mode] = [c.describe() for c in eng.runner.graphs.gemv_choices]
            for _ in range(4):
                eng.step()
            times[mode].append(timed_steps(eng, steps))
            log(f"kv={kv} B={B} L={L} KVGEN_PDL={mode}: {times[mode][-1]:.3f} ms a step")
    kv_bytes = B * (L + rounds * steps) * eng.plan.kv_bytes_per_token
    roof = (weight_bytes(eng) + kv_bytes) / bw * 1e3
    off, on = min(times["0"]), min(times["1"])
    rec = dict(kind="step", kv=kv, B=B, context=L, steps=steps, plain_ms=times["0"], pdl_ms=times["1"],
               best_plain_ms=off, best_pdl_ms=on, pdl_vs_plain=on / off, roofline_ms=roof,
               plain_vs_roofline=off / roof, pdl_vs_roofline=on / roof,
               graph_steps=eng.runner.graph_steps, gemv_choices=gemv_choices)
    log(json.dumps(rec))
    holder = [eng]
    del eng
    release(holder)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4,bf16")
    ap.add_argument("--shapes", default="1x16384,32x2048")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("pdl_step.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pdl_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    bw = copy_bandwidth()
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    records = [measure(kv, B, L, a.steps, a.rounds, bw) for B, L in shapes for kv in a.kv.split(",")]
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bandwidth=bw, date=datetime.date.today().isoformat(), records=records)
    write_atomic(a.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
