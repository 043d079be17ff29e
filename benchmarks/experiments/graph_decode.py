"""Experiment: bf16 decode and contiguous SDPA timed alone, under CUDA graphs, and the host cost of a launch.

    python -m benchmarks.experiments.graph_decode [--configs RESULTS_JSON] [--out DIR]

At each anchor shape of benchmarks.run, with the config the autotuner chose in
RESULTS_JSON (a benchmarks.run results file; default config where it has none):
``do_bench`` median (as benchmarks.run times it), ``do_bench_cudagraph`` median
(launches replayed from a graph, as serving engines run decode steps), and
the host microseconds one ``launch()`` / one SDPA call takes. Question: how
much of the gap to SDPA in benchmarks.run is the kernel, and how much the
launch (two kernels for split-K, plus the Python wrapper)?
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks import run as bench_run
from benchmarks.experiments.gaps import bench_graph


def host_us(fn, n=200) -> float:
    """Host time per call with the GPU queue never empty (launches are asynchronous)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="benchmarks/results/2026-11-29-nvidia-h200/bench-decode/results.json")
    ap.add_argument("--out", default="/tmp/kvgen-graph")
    args = ap.parse_args(argv)
    chosen = {}
    if Path(args.configs).exists():
        for r in json.loads(Path(args.configs).read_text())["records"]:
            if r["op"] == "decode" and r["scheme"] == "bf16":
                chosen[(r["B"], r["L"], r["Hq"], r["Hkv"], r["D"])] = r.get("config")
    rows = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in bench_run.ANCHOR_SHAPES:
        B, L, Hq, Hkv, D = shape
        mod, scheme = bench_run.kernel_module("decode", "bf16", Hkv, Hq // Hkv, D)
        case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
        cfg = chosen.get(shape) or mod.default_config(B, L, "cuda")
        out = torch.empty_like(case.q)
        sm = 1 / math.sqrt(D)
        ours = lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens,  # noqa: E731
                                  case.num_compressed, sm, cfg)
        q = case.q.view(B, Hq, 1, D)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, case.k_raw, case.v_raw,  # noqa: E731
                                                                          enable_gqa=True)
        row = dict(shape=shape, config=cfg, bytes=case.bytes,
                   ms=bench_run.bench(ours), graph_ms=bench_graph(ours), host_us=host_us(ours),
                   sdpa_ms=bench_run.bench(sdpa), sdpa_graph_ms=bench_graph(sdpa), sdpa_host_us=host_us(sdpa))
        row["x_sdpa"] = row["ms"] / row["sdpa_ms"]
        row["x_sdpa_graph"] = row["graph_ms"] / row["sdpa_graph_ms"]
        rows.append(row)
        print(f"B{B:<3} L{L:<7} {Hq}/{Hkv} D{D:<4} do_bench {row['ms']:.4f} ms (x{row['x_sdpa']:.3f} SDPA {row['sdpa_ms']:.4f})  "
              f"graph {row['graph_ms']:.4f} ms (x{row['x_sdpa_graph']:.3f} SDPA {row['sdpa_graph_ms']:.4f})  "
              f"host {row['host_us']:.1f} us (SDPA {row['sdpa_host_us']:.1f})  {cfg}", flush=True)
        (out_dir / "graph_decode.json").write_text(json.dumps(rows, indent=1) + "\n")
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
