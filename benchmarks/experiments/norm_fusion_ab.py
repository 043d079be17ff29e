"""Experiment: what does moving the residual add + RMSNorm into the small GEMMs save a decode step? (GPU)

    python -m benchmarks.experiments.norm_fusion_ab [--kv int4,bf16] [--shapes 32x2048] [--rounds 3]
                                                    [--steps 24] [--out norm_fusion_ab.json]

Where the small GEMM runs o and down, they add their output into the residual
stream in their epilogue and the next projection (q/k/v, gate/up) applies the
RMSNorm on the way in (``gemv.residual_linear``, ``gemv.DeferredNorm``): no
norm kernel between two small GEMMs (64 launches a Llama-3-8B step). Per
scheme and shape one engine; its decode graphs are captured again for each
variant in turn -- ``norm_fused`` (as the engine runs) and ``norm_kernel``
(``residual_linear`` declining everywhere: the add + RMSNorm kernel, as
before) -- ``rounds`` times, alternating, because the context grows with every
measurement. A record: the variant, the round, the best of two timed runs of
``steps`` steps (ms a step) and the context then. Compare neighbours, or fit
the drift from one variant's rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from benchmarks.engine import filled_engine, log, parse_shape, release, timed_steps
from kvgen.atomic import write_atomic

WARMUP = 4


def _declined(*args, **kwargs):
    return None


def measure(kv: str, B: int, L: int, rounds: int, steps: int) -> list[dict]:
    from kvgen.engine import gemv
    from kvgen.engine.graphs import DecodeGraphs

    variants = {"norm_fused": gemv.residual_linear, "norm_kernel": _declined}
    per_variant = WARMUP + 2 * steps
    eng = filled_engine(kv, B, L, L + rounds * len(variants) * per_variant + 256, async_scheduling=True)
    records = []
    try:
        for rnd in range(rounds):
            for name, fn in variants.items():
                gemv.residual_linear = fn
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
    finally:
        gemv.residual_linear = variants["norm_fused"]
    holder = [eng]
    del eng
    release(holder)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4,bf16")
    ap.add_argument("--shapes", default="32x2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default="norm_fusion_ab.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_fusion_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    records = [r for B, L in shapes for kv in a.kv.split(",") for r in measure(kv, B, L, a.rounds, a.steps)]
    write_atomic(a.out, json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
