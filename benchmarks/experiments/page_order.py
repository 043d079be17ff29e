"""Does the paged decode lose to SDPA on where its pages lie? The same kernel on random and on contiguous pages.

``benchmarks.run`` times kvgen's decode cold, on random pages
(``kernel_timer.cold_page_tables``: every row's pages drawn at random from a
pool), and SDPA on contiguous K/V. At D=64 a page of one KV head is 2 KB
(16 tokens x 128 bytes), at D=128 4 KB, so the random order hands DRAM half
as long a run per page at D=64, where bf16 runs at 1.05-1.06x SDPA (0.84 of
the copy bandwidth on an H100, against 0.97 at D=128). Here each scheme's
every candidate is timed by the same graph timer on the cold tables as
drawn (``random``) and on tables of the same shape over the same pool in
which every row's pages are consecutive and the rows follow one another
(``contiguous``: a freshly prefilled batch's layout); SDPA alongside. If
``contiguous`` reaches SDPA and ``random`` does not, the gap is the page
order's, not the kernel's.

Usage (on a GPU): ``python -m benchmarks.experiments.page_order --schemes bf16,int8 --shapes 16x8192:32,4,64
--shapes 32x4096:64,8,128 [--out FILE]``. Schemes without a residual tail (bf16, fp16, fp8, int8) only.
"""

from __future__ import annotations

import argparse
import math
import sys

from benchmarks.experiments.records import write_records


def contiguous_tables(tables: list, pool_rows: int) -> list:
    """Tables of the shape of ``tables`` in which copy i holds pages i * B * P .. as rows of consecutive ids."""
    import torch

    B, P = tables[0].shape
    if len(tables) * B * P > pool_rows:
        raise ValueError(f"{len(tables)} copies of {B} x {P} pages do not fit a pool of {pool_rows}")
    return [torch.arange(i * B * P, (i + 1) * B * P, dtype=torch.int32, device=t.device).view(B, P)
            for i, t in enumerate(tables)]


def measure(scheme_name: str, B: int, L: int, Hq: int, Hkv: int, D: int) -> dict:
    import torch

    from benchmarks.run import DecodeCase, best_config, kernel_module, sdpa_decode_times
    from kvgen.runtime.kernel_timer import cold_page_tables, cycling, graph_time_ms

    mod, scheme = kernel_module("decode", scheme_name, Hkv, Hq // Hkv, D, backend="cuda")
    case = DecodeCase(scheme, B, L, Hq, Hkv, D)
    if int(case.num_compressed[0]) != case.block_tables.shape[1]:
        raise SystemExit(f"{scheme_name}: a residual tail; this experiment takes schemes without one")
    sm = 1 / math.sqrt(D)
    out = torch.empty_like(case.q)
    pools, rand = cold_page_tables(case.pools, B, case.block_tables.shape[1], case.block_tables.shape[1])
    rows = min(t.shape[0] for n, t in pools.items() if n not in ("rk", "rv"))
    contig = contiguous_tables(rand, rows)
    rec = {"scheme": scheme_name, "B": B, "L": L, "heads": [Hq, Hkv], "head_dim": D, "copies": len(rand),
           "sdpa_ms": sdpa_decode_times(case, timers=("graph",))["graph"]}
    for order, tables in (("random", rand), ("contiguous", contig), ("random again", rand)):
        ms, cfg, times = best_config(mod, None, B, L, lambda c, tables=tables: graph_time_ms(cycling(
            tables, lambda bt: mod.launch(case.q, out, pools, bt, case.seq_lens, case.num_compressed, sm, c))))
        rec[order] = {"ms": ms, "config": cfg, "x_sdpa": ms / rec["sdpa_ms"], "candidates": times}
        print(f"{scheme_name:5s} B={B:3d} L={L:6d} D={D:3d} {order:12s} {ms * 1e3:7.1f} us  x{ms / rec['sdpa_ms']:.3f} "
              f"SDPA ({rec['sdpa_ms'] * 1e3:.1f} us)  {cfg}", flush=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="bf16,int8")
    p.add_argument("--shapes", action="append", default=None, help="BxL:HQ,HKV,D (repeatable)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    shapes = a.shapes or ["16x8192:32,4,64", "32x4096:64,8,128"]
    records = []
    for shape in shapes:
        bl, heads = shape.split(":")
        B, L = (int(x) for x in bl.split("x"))
        Hq, Hkv, D = (int(x) for x in heads.split(","))
        for s in a.schemes.split(","):
            records.append(measure(s, B, L, Hq, Hkv, D))
            torch.cuda.empty_cache()
            if a.out:  # rewritten after each record: a cut run keeps what it measured
                write_records(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
