"""Whether a long decode's cold graph timing depends on the pool's place in memory or on its random page order.

``timing-context`` (2026-12-05, H100) read int8 at 1 x 131072 at 101.4 us by
the graph timer when the table ran that case alone and 117.6 us when other
cases ran first, with the same config (33/4/2), while ``do_bench`` read 113
both times; SDPA's graph reading moved the other way (213 against 182). One
call there reads 277 MB, more than three L2s, so the graph timer reads the
case's own pool through one random page table (``cold_page_tables``): nothing
but the pool's physical place and the table's order changed.

This separates the two, in one process, for each scheme at one shape:

- ``orders``: one pool, ``--orders`` fresh random tables (new generator seeds), each timed twice by the graph timer
  (the spread between seeds against the spread between repeats);
- ``places``: ``--places`` pools of the same case built after spacer allocations of different sizes (each pool
  lands elsewhere), the same seed's table, graph and ``do_bench``;
- ``sdpa``: SDPA's graph time on K/V copies allocated after the same spacers;
- ``first``: each replay's time, in order, of one graph of back-to-back cold calls replayed ``FIRST_REPLAYS`` times
  right after a fresh case is built, then after the GPU sat idle ``IDLE_S`` s, then right after a 1 GB fill: how
  long a slow start lasts, and what brings it; then ``--trace`` replays more in a row, with the runs of slow ones
  (over ``SLOW`` times the trace's fastest) counted: how often a slow stretch comes mid-run, and how long it lasts.

Usage (on a GPU): ``python -m benchmarks.experiments.placement_timing --schemes int8,bf16 --shape 1x131072
[--config 33/4/2] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from benchmarks.experiments.records import write_records

SPACER_MB = (0, 64, 300, 1000, 2500)
FIRST_REPLAYS = 40
IDLE_S = 3.0
SLOW = 1.08


def _config(text: str) -> dict:
    s, w, d = (int(x) for x in text.split("/"))
    return {"num_splits": s, "num_warps": w, "depth": d}


def _spread(xs: list[float]) -> dict:
    if not xs:
        return {}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "max_over_min": max(xs) / min(xs)}


def measure(scheme_name: str, B: int, L: int, Hq: int, Hkv: int, D: int, cfg: dict, orders: int,
            places: int) -> dict:
    import torch

    from benchmarks.decode_timing import DecodeTimer, do_bench_ms
    from benchmarks.run import DecodeCase, kernel_module
    from kvgen.runtime.kernel_timer import graph_time_ms

    mod, scheme = kernel_module("decode", scheme_name, Hkv, Hq // Hkv, D, backend="cuda")
    sm = 1 / math.sqrt(D)
    rec = {"scheme": scheme_name, "B": B, "L": L, "heads": [Hq, Hkv], "head_dim": D, "config": cfg}

    def timer_for(case, seed):
        torch.manual_seed(seed)  # cold_page_tables draws its table from the global generator
        return DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0]))

    def graph_ms(case, dt):
        out = torch.empty_like(case.q)
        return graph_time_ms(dt.cold_call(
            lambda c, pools, tables: mod.launch(case.q, out, pools, tables, case.seq_lens, case.num_compressed,
                                                sm, c), cfg))

    case, dt = DecodeCase(scheme, B, L, Hq, Hkv, D), None
    rec["orders"] = []
    for seed in range(orders):
        dt = timer_for(case, seed)
        rec["orders"].append({"seed": seed, "graph_us": [graph_ms(case, dt) * 1e3 for _ in range(2)]})
        print(f"{scheme_name} order seed {seed}: " + " ".join(f"{x:.1f}" for x in rec["orders"][-1]["graph_us"]),
              flush=True)
    del case, dt  # (the timer holds the pool too)
    torch.cuda.empty_cache()

    rec["places"] = []
    for mb in SPACER_MB[:places]:
        spacer = torch.empty(mb << 20, dtype=torch.uint8, device="cuda") if mb else None
        case = DecodeCase(scheme, B, L, Hq, Hkv, D)
        dt = timer_for(case, 0)
        out = torch.empty_like(case.q)
        bench = do_bench_ms(lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens,
                                               case.num_compressed, sm, cfg))
        g = [graph_ms(case, dt) * 1e3 for _ in range(2)]
        addr = min(t.data_ptr() for t in case.pools.values())
        rec["places"].append({"spacer_mb": mb, "pool_address": hex(addr), "graph_us": g, "do_bench_us": bench * 1e3})
        print(f"{scheme_name} after {mb:4d} MB spacer (pool at {addr:#x}): graph " + " ".join(f"{x:.1f}" for x in g)
              + f", do_bench {bench * 1e3:.1f}", flush=True)
        del case, dt, out, spacer
        torch.cuda.empty_cache()
    every_order = [x for o in rec["orders"] for x in o["graph_us"]]
    every_place = [x for p in rec["places"] for x in p["graph_us"]]
    rec["order_spread"], rec["place_spread"] = _spread(every_order), _spread(every_place)
    print(f"{scheme_name}: across orders x{rec['order_spread'].get('max_over_min', float('nan')):.3f}, "
          f"across places x{rec['place_spread'].get('max_over_min', float('nan')):.3f}", flush=True)
    return rec


def slow_runs(times: list[float]) -> list[list[int]]:
    """``[start, length]`` of each run of consecutive replays slower than ``SLOW`` times the fastest."""
    floor, runs = min(times), []
    for i, t in enumerate(times):
        if t > SLOW * floor:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
    return runs


def first_replays(scheme_name: str, B: int, L: int, Hq: int, Hkv: int, D: int, cfg: dict, trace: int) -> dict:
    import time

    import torch

    from benchmarks.decode_timing import DecodeTimer
    from benchmarks.run import DecodeCase, kernel_module

    mod, scheme = kernel_module("decode", scheme_name, Hkv, Hq // Hkv, D, backend="cuda")
    sm = 1 / math.sqrt(D)
    case = DecodeCase(scheme, B, L, Hq, Hkv, D)
    torch.manual_seed(0)
    dt = DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0]))
    out = torch.empty_like(case.q)
    call = dt.cold_call(lambda c, pools, tables: mod.launch(case.q, out, pools, tables, case.seq_lens,
                                                            case.num_compressed, sm, c), cfg)
    calls = 10
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                call()
    torch.cuda.synchronize()

    def replays(n: int = FIRST_REPLAYS) -> list[float]:
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls * 1e3)
        return times

    rec = {"scheme": scheme_name, "B": B, "L": L, "config": cfg, "calls_per_replay": calls,
           "after_build_us": replays()}
    time.sleep(IDLE_S)
    rec["after_idle_us"] = replays()
    fill = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    fill.fill_(1)
    rec["after_fill_us"] = replays()
    del fill
    for k in ("after_build_us", "after_idle_us", "after_fill_us"):
        print(f"{scheme_name} {k}: " + " ".join(f"{x:.0f}" for x in rec[k]), flush=True)
    if trace:
        t = rec["trace_us"] = replays(trace)
        runs = rec["trace_slow_runs"] = slow_runs(t)
        slow = sum(n for _, n in runs)
        print(f"{scheme_name} trace of {trace}: fastest {min(t):.1f}, median {statistics.median(t):.1f} us; "
              f"{slow} slow (>{SLOW:g}x) in {len(runs)} runs: " + " ".join(f"{a}+{n}" for a, n in runs[:30]),
              flush=True)
    return rec


def sdpa(B: int, L: int, Hq: int, Hkv: int, D: int, places: int) -> dict:
    import torch

    from benchmarks.decode_timing import sdpa_times

    rows = []
    for mb in SPACER_MB[:places]:
        spacer = torch.empty(mb << 20, dtype=torch.uint8, device="cuda") if mb else None
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t = [sdpa_times(q, k, v, timers=("graph",))["graph"] * 1e3 for _ in range(2)]
        rows.append({"spacer_mb": mb, "k_address": hex(k.data_ptr()), "graph_us": t})
        print(f"sdpa after {mb:4d} MB spacer: graph " + " ".join(f"{x:.1f}" for x in t), flush=True)
        del q, k, v, spacer
        torch.cuda.empty_cache()
    return {"scheme": "sdpa", "B": B, "L": L, "places": rows,
            "place_spread": _spread([x for r in rows for x in r["graph_us"]])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="int8,bf16")
    p.add_argument("--shape", default="1x131072")
    p.add_argument("--heads", default="64,8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--config", default="33/4/2", help="splits/warps/depth, timed for every scheme")
    p.add_argument("--orders", type=int, default=4)
    p.add_argument("--places", type=int, default=len(SPACER_MB))
    p.add_argument("--trace", type=int, default=0, help="replays in a row after the first ones (0: none)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    Hq, Hkv = (int(x) for x in a.heads.split(","))
    B, L = (int(x) for x in a.shape.split("x"))
    records = []
    for s in a.schemes.split(","):
        records.append(first_replays(s, B, L, Hq, Hkv, a.head_dim, _config(a.config), a.trace))
        torch.cuda.empty_cache()
        records.append(measure(s, B, L, Hq, Hkv, a.head_dim, _config(a.config), a.orders, a.places))
        if a.out:
            write_records(a.out, records)
    records.append(sdpa(B, L, Hq, Hkv, a.head_dim, a.places))
    if a.out:
        write_records(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
