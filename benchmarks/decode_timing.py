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
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.runtime.kernel_timer import cold_copies, cold_page_tables, cycling, graph_time_ms

TIMERS = ("graph", "do_bench")


def do_bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """``triton.testing.do_bench``'s median (zero flush before every call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


class KernelTimer:
    """Times one paged decode kernel on a case's pool: ``ms(cfg)`` by the primary timer, ``both(cfg)`` by each.

    ``launch(cfg, pools, block_tables)`` runs the kernel once; the graph timer passes the tables of
    ``cold_page_tables`` (and the scratch pool they index, where the case's pool is too small to keep them
    apart), ``do_bench`` the case's own."""

    def __init__(self, launch, pools: dict[str, torch.Tensor], block_tables: torch.Tensor, compressed: int,
                 timer: str = "graph"):
        if timer not in TIMERS:
            raise ValueError(f"timer {timer!r}: one of {TIMERS}")
        self.launch, self.pools, self.block_tables, self.timer = launch, pools, block_tables, timer
        B, pages = block_tables.shape
        self.cold_pools, self.cold_tables = cold_page_tables(pools, B, pages, compressed)

    def _graph(self, cfg) -> float:
        return graph_time_ms(cycling(self.cold_tables, lambda bt: self.launch(cfg, self.cold_pools, bt)))

    def _do_bench(self, cfg, rep_ms: int = 200) -> float:
        return do_bench_ms(lambda: self.launch(cfg, self.pools, self.block_tables), rep_ms)

    def ms(self, cfg, quick: bool = False) -> float:
        """The primary timer's ms (``quick``: do_bench's shorter run, for ranking candidates)."""
        return self._graph(cfg) if self.timer == "graph" else self._do_bench(cfg, 60 if quick else 200)

    def both(self, cfg) -> dict[str, float]:
        return {"graph": self._graph(cfg), "do_bench": self._do_bench(cfg)}


def sdpa_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Contiguous SDPA decode (``q`` [B, Hq, 1, D], ``k``/``v`` [B, Hkv, L, D]) by each timer; the graph timer
    cycles through copies of K/V where one call reads less than ``COLD_FACTOR`` L2 caches."""
    f = torch.nn.functional.scaled_dot_product_attention
    copies = cold_copies(2 * k.numel() * k.element_size(), k.device)
    kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
    turn = [0]

    def cold():
        kk, vv = kv[turn[0] % len(kv)]
        turn[0] += 1
        return f(q, kk, vv, enable_gqa=True)
    cold.cycle = len(kv)
    graph = graph_time_ms(cold)
    del kv
    return {"graph": graph, "do_bench": do_bench_ms(lambda: f(q, k, v, enable_gqa=True))}


__all__ = ["KernelTimer", "TIMERS", "do_bench_ms", "sdpa_times"]
