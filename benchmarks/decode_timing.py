"""How ``benchmarks.run`` times one decode call: cold in L2, from a CUDA graph, as a model's step runs it.

Two timers, both reported:

- ``graph``: :func:`kvgen.runtime.kernel_timer.graph_time_ms`, the runtime's
  autotuner timer: back-to-back calls replayed from a CUDA graph, each finding
  its KV cold in L2 (kvgen's kernels cycle through
  :func:`~kvgen.runtime.kernel_timer.cold_page_tables`; SDPA through copies of
  its K/V where one call reads less than ``COLD_FACTOR`` L2 caches). That is
  how the engine runs decode: captured, after kernels that read weights.
- ``do_bench``: ``triton.testing.do_bench`` (a Python launch per call after
  an L2 flush), ``benchmarks.run``'s timer until 2026-12-03. Its flush zeroes a
  256 MB buffer, which leaves L2 full of dirty lines; the timed call then pays
  their write-back to DRAM while it reads, about the same microseconds for
  every kernel, so it weighs more on a short compressed kernel than on bf16
  (``benchmarks/experiments/flush_timing.py`` measures it).

The graph timer's reading is the fastest of ``GRAPH_ROUNDS`` rounds (each
one :func:`graph_time_ms`, all kept as ``graph_rounds``): an H100 ran
stretches of back-to-back calls about 15% slower, at unchanged clocks, for
SDPA and kvgen's kernels alike (int8 at 1 x 131072: 118 us against 102;
``benchmarks/experiments/placement_timing.py``, results in
``benchmarks/results/2026-12-05-nvidia-h100-4``). A single round that fell
into one moved a table's ratios by that much either way.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.runtime.kernel_timer import cold_copies, cold_page_tables, cycling, graph_time_ms

TIMERS = ("graph", "do_bench")
GRAPH_ROUNDS = 3


def graph_rounds_ms(fn: Callable[[], object], rounds: int = GRAPH_ROUNDS) -> list[float]:
    """``rounds`` readings of :func:`graph_time_ms` on ``fn``, one after another (their minimum is the reading)."""
    return [graph_time_ms(fn) for _ in range(rounds)]


def do_bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """``triton.testing.do_bench``'s median (zero flush before every call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


class DecodeTimer:
    """Times paged decode kernels on one case's pool, by the primary timer (``ms``) or by each (``both``).

    ``launch(cfg, pools, block_tables)`` runs a kernel once. The graph timer passes it the tables of
    ``cold_page_tables`` (and the scratch pool they index, where the case's pool is too small to keep them apart),
    made once here for every kernel timed on this case; ``do_bench`` passes the case's own."""

    def __init__(self, pools: dict[str, torch.Tensor], block_tables: torch.Tensor, compressed: int,
                 timer: str = "graph"):
        if timer not in TIMERS:
            raise ValueError(f"timer {timer!r}: one of {TIMERS}")
        self.pools, self.block_tables, self.timer = pools, block_tables, timer
        B, pages = block_tables.shape
        self.cold_pools, self.cold_tables = cold_page_tables(pools, B, pages, compressed)

    def cold_call(self, launch, cfg) -> Callable[[], object]:
        """A call of ``launch`` at ``cfg`` that takes the cold tables in turn (``cycle`` set for graph_time_ms)."""
        return cycling(self.cold_tables, lambda bt: launch(cfg, self.cold_pools, bt))

    def _do_bench(self, launch, cfg, rep_ms: int = 200) -> float:
        return do_bench_ms(lambda: launch(cfg, self.pools, self.block_tables), rep_ms)

    def ms(self, launch, cfg, quick: bool = False) -> float:
        """The primary timer's ms (``quick``, for ranking candidates: one graph round, or do_bench's shorter run)."""
        if self.timer == "graph":
            return min(graph_rounds_ms(self.cold_call(launch, cfg), 1 if quick else GRAPH_ROUNDS))
        return self._do_bench(launch, cfg, 60 if quick else 200)

    def both(self, launch, cfg) -> dict:
        """``{"graph": fastest round, "graph_rounds": [...], "do_bench": ms}``."""
        rounds = graph_rounds_ms(self.cold_call(launch, cfg))
        return {"graph": min(rounds), "graph_rounds": rounds, "do_bench": self._do_bench(launch, cfg)}


def sdpa_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timers=TIMERS) -> dict:
    """Contiguous SDPA decode (``q`` [B, Hq, 1, D], ``k``/``v`` [B, Hkv, L, D]) by each of ``timers`` (with
    ``graph_rounds`` where the graph timer ran); the graph timer cycles through copies of K/V where one call reads
    less than ``COLD_FACTOR`` L2 caches."""
    f = torch.nn.functional.scaled_dot_product_attention
    out = {}
    if "graph" in timers:
        copies = cold_copies(2 * k.numel() * k.element_size(), k.device)
        kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
        out["graph_rounds"] = graph_rounds_ms(cycling(kv, lambda pair: f(q, *pair, enable_gqa=True)))
        out["graph"] = min(out["graph_rounds"])
        del kv
    if "do_bench" in timers:
        out["do_bench"] = do_bench_ms(lambda: f(q, k, v, enable_gqa=True))
    return out


__all__ = ["DecodeTimer", "GRAPH_ROUNDS", "TIMERS", "do_bench_ms", "graph_rounds_ms", "sdpa_times"]
