"""Experiment: does the autotuner's timer pick the fastest decode config for a short kernel?

    python -m benchmarks.experiments.decode_timer [--schemes bf16,int4] [--shapes 1x16384,32x2048]

One layer of Llama-3-8B's decode attention (32/8 heads, D=128, page 16) at the
engine benchmark's shapes. Every tuning candidate is timed three ways: as
the runtime's autotuner timed it until 2026-12-02
(``kvgen.runtime.kernel_timer.do_bench_ms``: a Python launch per call after an
L2 flush), as it times it now (``graph_time_ms``: a CUDA graph of calls on one
input set), and from a CUDA graph of back-to-back calls over 8 input sets
(``benchmarks.run.bench_cold``; what a captured engine step sees, cold in L2). A kernel shorter than its launch is timed by its
launch in the first way, so the tuner's pick can be far from the fastest.
Prints, per scheme and shape: contiguous SDPA (graph-timed), the tuner's pick
and the graph's pick, each with both times, and the heuristic default.
"""

import argparse
import math
import sys

import torch

from benchmarks import run as bench_run
from kvgen.runtime.autotune_model import model_config
from kvgen.runtime.kernel_timer import do_bench_ms, graph_time_ms

Hq, Hkv, D, COPIES = 32, 8, 128, 8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="bf16,int4")
    ap.add_argument("--shapes", default="1x16384,32x2048")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        sdpa_ms = None
        for name in args.schemes.split(","):
            mod, scheme = bench_run.kernel_module("decode", name, Hkv, Hq // Hkv, D)
            cases = [bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D, seed=i) for i in range(COPIES)]
            outs = [torch.empty_like(c.q) for c in cases]
            if sdpa_ms is None:
                f = torch.nn.functional.scaled_dot_product_attention
                qs = [c.q.view(B, Hq, 1, D) for c in cases]
                sdpa_ms = bench_run.bench_cold([lambda c=c, q=q: f(q, c.k_raw, c.v_raw, enable_gqa=True)
                                                for c, q in zip(cases, qs)])
                print(f"B={B} L={L}: SDPA {sdpa_ms * 1e3:.1f} us (graph)", flush=True)

            def call(i, cfg):
                c = cases[i]
                return lambda: mod.launch(c.q, outs[i], c.pools, c.block_tables, c.seq_lens, c.num_compressed,
                                          1 / math.sqrt(D), cfg)

            rows = []
            for cfg in mod.candidates(B, L):
                try:
                    tuner_ms = do_bench_ms(call(0, cfg))
                    new_ms = graph_time_ms(call(0, cfg))
                    graph_ms = bench_run.bench_cold([call(i, cfg) for i in range(COPIES)])
                except Exception as exc:  # registers / shared memory
                    print(f"  {name} {cfg} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                rows.append((tuner_ms, graph_ms, cfg, new_ms))
            default = mod.default_config(B, L, "cuda")
            dflt = bench_run.bench_cold([call(i, default) for i in range(COPIES)])
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            model = model_config("decode", mod, (B, L), sms)
            model_ms = bench_run.bench_cold([call(i, model) for i in range(COPIES)])
            print(f"  {name:5} the runtime's untuned choice (autotune_model) {model}: graph {model_ms * 1e3:.1f} us",
                  flush=True)
            by_tuner = min(rows, key=lambda r: r[0])
            by_graph = min(rows, key=lambda r: r[1])
            by_new = min(rows, key=lambda r: r[3])
            print(f"  {name:5} {len(rows)} candidates; default {default}: graph {dflt * 1e3:.1f} us", flush=True)
            for label, (t, g, cfg, _) in (("do_bench's pick (the tuner before)", by_tuner),
                                          ("graph_time_ms's pick (the tuner now)", by_new),
                                          ("cold graph's pick", by_graph)):
                print(f"  {name:5} {label}: do_bench {t * 1e3:.1f} us, graph {g * 1e3:.1f} us "
                      f"(x{g / sdpa_ms:.2f} SDPA)  {cfg}", flush=True)
            spread = sorted(r[0] for r in rows)
            for t, g, cfg, n in sorted(rows, key=lambda r: r[1])[:5]:
                print(f"  {name:5}   cold graph {g * 1e3:.1f} us, graph {n * 1e3:.1f} us, do_bench {t * 1e3:.1f} us  {cfg}",
                      flush=True)
            print(f"  {name:5} do_bench times span {spread[0] * 1e3:.1f}-{spread[-1] * 1e3:.1f} us; graph times "
                  f"{min(r[1] for r in rows) * 1e3:.1f}-{max(r[1] for r in rows) * 1e3:.1f} us", flush=True)
            del cases, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
