"""Experiment: the engine's single-row GEMV (kvgen.engine.fused.gemv) against torch's GEMM at batch 1.

The projections of a Llama-3-8B layer (q/k/v, o, gate/up, down) and the LM head, bf16, one row; each timed
from a CUDA graph of 20 calls over 8 weight copies (cold in L2, as in a model's step), and the fraction of
the copy bandwidth its weight bytes reach.

    python -m benchmarks.experiments.gemv [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def graph_ms(fn, calls: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gemv.json")
    args = ap.parse_args(argv)
    from benchmarks.run import copy_bandwidth
    from kvgen.engine import fused

    bw = copy_bandwidth()
    records = []
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(8)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        turn = iter(range(10**9))
        rec = {"name": name, "N": N, "K": K, "bytes": N * K * 2}
        for label, f in (("torch", torch.nn.functional.linear), ("gemv", fused.gemv)):
            rec[f"{label}_ms"] = graph_ms(lambda: f(x, ws[next(turn) % 8]))
            rec[f"{label}_bw"] = rec["bytes"] / (rec[f"{label}_ms"] * 1e-3) / bw
        ref = torch.nn.functional.linear(x, ws[0]).double()
        rec["rel_l2"] = float((fused.gemv(x, ws[0]).double() - ref).norm() / ref.norm())
        records.append(rec)
        print(f"{name:8s} N={N:6d} K={K:5d}  torch {rec['torch_ms']:.4f} ms ({rec['torch_bw']:.2f})  "
              f"gemv {rec['gemv_ms']:.4f} ms ({rec['gemv_bw']:.2f})  rel_l2 {rec['rel_l2']:.2e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bw,
                   "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
