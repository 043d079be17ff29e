"""Experiment: what do_bench's L2 flush adds to a decode kernel's time.

    python -m benchmarks.experiments.flush_timing [--schemes bf16,int8,int4] [--shapes 32x4096x64x8,...]
        [--out FILE.json]

``benchmarks.run`` times decode with ``triton.testing.do_bench``, which
before every call zeroes a 256 MB buffer to flush L2. Zeroing leaves L2 full
of dirty lines, and the timed kernel then pays their write-back to DRAM
while it reads its own KV: about an L2's worth of extra traffic per call,
the same absolute cost for every kernel, so a larger share of a short
(compressed) kernel's time than of bf16's. A model's decode step never has
that: the kernels before attention read weights (clean lines) and write
small activations.

Per scheme and shape (one layer of the ANCHORS shapes, page 16), the kernel
at its default config (CUDA where it serves the scheme) and contiguous
SDPA are timed four ways in one process:

- ``do_bench``: ``triton.testing.do_bench`` (zero flush; ``benchmarks.run``'s timing until now);
- ``read_flush``: the same loop with the flush a 256 MB *read* (L2 left clean);
- ``no_flush``: the same loop without a flush (warm where the data fits L2);
- ``graph_cold``: ``benchmarks.decode_timing``'s graph timer (the autotuner's:
  back-to-back calls from a CUDA graph over ``cold_page_tables``, each finding
  its pages cold, as in a captured engine step).

If the flush hypothesis holds, ``do_bench - read_flush`` is about the same
number of microseconds for every kernel, and ``read_flush`` is close to
``graph_cold``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from benchmarks import run as bench_run
from benchmarks.decode_timing import DecodeTimer
from kvgen.runtime.kernel_timer import graph_time_ms

FLUSH_BYTES = 256 * 2**20
REPS = 100


def event_loop_ms(fn, flush) -> float:
    """Median ms of ``fn`` timed by CUDA events around each call, ``flush()`` (or nothing) before each."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(REPS):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def four_ways(fn, cold_fn, buf, sink) -> dict[str, float]:
    return {"do_bench": bench_run.bench(fn),
            "read_flush": event_loop_ms(fn, lambda: torch.sum(buf, dim=0, dtype=torch.int64, out=sink)),
            "no_flush": event_loop_ms(fn, None),
            "graph_cold": graph_time_ms(cold_fn)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--shapes", default="32x4096x64x8,1x131072x64x8,64x2048x32x8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    records = []
    for shape in args.shapes.split(","):
        B, L, Hq, Hkv = (int(x) for x in shape.split("x"))
        D, sm = 128, 1 / math.sqrt(128)
        for name in args.schemes.split(","):
            be = bench_run.decode_backends(name, Hkv, Hq // Hkv, D, "cuda") or ["triton"]
            mod, scheme = bench_run.kernel_module("decode", name, Hkv, Hq // Hkv, D, backend=be[0])
            case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
            out = torch.empty_like(case.q)
            dt = DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0]))

            def launch(cfg, pools, tables):
                mod.launch(case.q, out, pools, tables, case.seq_lens, case.num_compressed, sm, cfg)

            cfg = mod.default_config(B, L, device="cuda")  # one config shows the timers apart
            rec = dict(B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, kernel=f"kvgen {name}", backend=be[0], config=cfg,
                       bytes=case.bytes, **four_ways(lambda: launch(cfg, case.pools, case.block_tables),
                                                     dt.cold_call(launch, cfg), buf, sink))
            records.append(rec)
            print(json.dumps(rec), flush=True)
            if name == args.schemes.split(",")[0]:
                q = case.q.view(B, Hq, 1, D)
                f = torch.nn.functional.scaled_dot_product_attention
                call = lambda: f(q, case.k_raw, case.v_raw, enable_gqa=True)  # noqa: E731
                rec = dict(B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, kernel="sdpa", bytes=2 * case.k_raw.numel() * 2,
                           **four_ways(call, call, buf, sink))
                records.append(rec)
                print(json.dumps(rec), flush=True)
            del case, dt
            torch.cuda.empty_cache()
    print(f"{'kernel':<12}{'shape':<18}" + "".join(f"{k:>12}" for k in ("do_bench", "read_flush", "no_flush",
                                                                         "graph_cold", "zero-read us")))
    for r in records:
        print(f"{r['kernel']:<12}{r['B']}x{r['L']}x{r['Hq']}/{r['Hkv']:<8}"
              + "".join(f"{r[k] * 1e3:>12.1f}" for k in ("do_bench", "read_flush", "no_flush", "graph_cold"))
              + f"{(r['do_bench'] - r['read_flush']) * 1e3:>12.1f}")
    if args.out:
        from kvgen.atomic import write_atomic
        write_atomic(args.out, json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
