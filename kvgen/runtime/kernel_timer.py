"""How the autotuner times one candidate: GPU time per call, without the Python launch.

``graph_time_ms(fn)`` captures back-to-back calls of ``fn`` into a CUDA graph
and divides a replay's time by the calls in it. Why not
``triton.testing.do_bench``: it launches every call from Python after an L2
flush, so a kernel shorter than its own launch (a decode layer at B=1, 16K
tokens: ~25 us against ~40 us of launch) is timed by its launch, and the
tuner's pick is noise. Measured on an H200 (benchmarks/results/
2026-12-02-nvidia-h200-3/decode_timer.txt): at B=1, L=16384 do_bench's
pick decoded in 30.0 us per layer where the fastest candidate took 25.8; the
engine replays its decode steps from CUDA graphs, which is what this measures.

Data that fits in L2 would stay there between back-to-back calls, while in
a model every layer's attention finds its KV cold (the other layers'
weights and KV passed through L2 since its last step). So a bench cycles
through the block tables of :func:`cold_page_tables` (disjoint sets of
random pages, in a scratch pool where the caller's is too small to keep
them apart) and says so (``fn.cycle``); the graph holds whole turns of
them, so between two uses of one set about ``COLD_FACTOR`` L2 caches'
worth of other pages are read. Measured on an
H200 (2026-12-02, benchmarks/results/2026-12-02-nvidia-h200-5): on warm
inputs the CUDA bf16 decode at the 64-dim anchor timed 0.0388 ms against
Triton's 0.0406 and was chosen, yet ran at 1.12x SDPA under do_bench's
cold L2 where Triton ran at 1.00-1.04x.

A GPU that sat idle, or only ran short bursts between host work (a bench
building its inputs, the tuner compiling its next candidate), starts slow:
on an H100 (benchmarks/results/2026-12-05-nvidia-h100-4/4-first-replays) the
first 6 replays of int8 decode at 1 x 131072 right after its inputs were
built took 118 us a call, every later one 102, a step, not a ramp. The timer
therefore replays its graph untimed for ``WARM_MS`` first, unless it timed
something less than ``WARM_GAP_S`` ago or one replay lasts that long
(``warm_replays``); without that, a table's first timing after each case
build and the tuner's first candidate read up to 16% slow. The gap is a
guess at what brings a slow start: after 3 s idle only one replay was slow,
after a build six, and the timer sees only its own timings, not the GPU's
other work.

``fn`` must be capturable (no host synchronization); where capture fails
the timer falls back to do_bench (which flushes L2 itself). Off CUDA (the interpreter) it is do_bench too.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .pools import page_bytes

TARGET_MS = 1.0
"""Calls per graph are chosen so a replay lasts about this long (per-replay overhead below 1%)."""
MAX_CALLS = 200
REPLAYS = 11
LONG_REPLAYS = 3
COLD_FACTOR = 3
"""Between two uses of one input set, the timed calls read at least this many L2 caches' worth of others."""
MAX_COLD_COPIES = MAX_CALLS
WARM_MS = 20.0
"""Untimed replays before the timed ones last about this long (the slow start measured above lasted ~7 ms)."""
WARM_GAP_S = 0.5
"""A timing that starts within this many seconds of the previous one's end finds the GPU warm: no untimed replay."""
MAX_WARM_REPLAYS = 64
_last_end = [float("-inf")]  # time.monotonic() when the previous graph_time_ms finished
RESIDUAL_TENSORS = ("rk", "rv")
"""A residual scheme's compute-dtype page tensors in a layer's pool (the runtime's PagePool names them)."""


def l2_bytes(device: torch.device | str) -> int:
    """The L2 cache's size in bytes on a CUDA ``device``; 0 elsewhere (nothing to keep cold)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def cold_copies(working_set_bytes: int, device: torch.device | str) -> int:
    """How many distinct input sets, each reading ``working_set_bytes``, timed calls should cycle through so
    that none is still in L2 when it comes round again: 1 for a working set of ``COLD_FACTOR`` L2s or more
    (cold by itself), else ``ceil(COLD_FACTOR * L2 / working set) + 1`` (the others, read between two uses
    of one, add up to ``COLD_FACTOR`` L2s), at most ``MAX_COLD_COPIES``."""
    l2 = l2_bytes(device)
    ws = int(working_set_bytes)
    if l2 <= 0 or ws <= 0 or ws >= COLD_FACTOR * l2:
        return 1
    return min(MAX_COLD_COPIES, -(-COLD_FACTOR * l2 // ws) + 1)


def _distinct_pages(n: int, num_pages: int, device: torch.device) -> torch.Tensor:
    # n page ids of [0, num_pages), none twice where the pool has room (a repeat would hit L2 within a call)
    if n <= num_pages:
        return torch.randperm(num_pages, device=device)[:n].to(torch.int32)
    return torch.randint(0, max(1, num_pages), (n,), dtype=torch.int32, device=device)


def cold_page_tables(pool: Mapping[str, torch.Tensor], batch: int, pages: int, compressed: int,
                     read_pages: int | None = None, *, alternating: bool = False
                     ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Block tables, and the pool they index, for timing a kernel that reads ``batch`` rows of ``pages`` pages
    of ``pool`` (one layer's page tensors; the first ``compressed`` entries of a row point into its compressed
    tensors, the rest into :data:`RESIDUAL_TENSORS`), each call finding its pages cold.

    Returns ``(pools, tables)``: timed calls should take ``tables[i % len(tables)]`` in turn (and tell
    :func:`graph_time_ms` so: ``fn.cycle = len(tables)``). Where one call reads three L2s or more (of
    ``read_pages`` pages a row, default ``pages``: a prefill reads only its cached prefix) this is ``pool``
    with one table of distinct random pages (repeats only where the pool is smaller than the call). Otherwise
    the tables index a scratch pool of the same layout, zero-filled, holding :func:`cold_copies` disjoint sets
    of the pages a call reads (the pool a caller sized for one call, ``kvgen tune``'s or a benchmark's, could
    not keep them apart). Entries a call does not read (a prefill chunk's own pages) all point at one page,
    the last of their pool. ``alternating``: calls alternate between reading every read page and half of them
    (a decode timed over its bucket's range): the copies are counted for three quarters of the working set, so
    that ``COLD_FACTOR`` L2s still pass between two uses of one, and made even (when more than one), so that
    each table always serves the same one of the two lengths.
    """
    device = next(iter(pool.values())).device
    comp = {n: t for n, t in pool.items() if n not in RESIDUAL_TENSORS}
    res = {n: t for n, t in pool.items() if n in RESIDUAL_TENSORS}
    compressed = min(compressed, pages) if res else pages
    read = pages if read_pages is None else min(read_pages, pages)
    read_comp = min(read, compressed)  # a row reads its leading pages: compressed ones first, then residual
    read_res = read - read_comp
    ws = batch * (read_comp * page_bytes(comp) + read_res * page_bytes(res))
    copies = cold_copies(ws * 3 // 4 if alternating else ws, device)
    if alternating and copies > 1:
        copies += copies % 2
    n_comp, n_res = batch * read_comp, batch * read_res
    if copies > 1:
        def scratch(tensors: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
            return {k: torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=device) for k, t in tensors.items()}
        # the pages read, and one more that every unread entry (a prefill chunk's own pages) points at
        comp, res = scratch(comp, copies * n_comp + 1), scratch(res, copies * n_res + 1)
        pool = {**comp, **res}
    comp_rows = next(iter(comp.values())).shape[0]  # the pages the tables index (the scratch pool's, if one)
    res_rows = next(iter(res.values())).shape[0] if res else 0
    ids_c = _distinct_pages(copies * n_comp, comp_rows, device).view(copies, batch, read_comp)
    ids_r = _distinct_pages(copies * n_res, res_rows, device).view(copies, batch, read_res)
    unread_c = torch.full((batch, compressed - read_comp), max(comp_rows - 1, 0), dtype=torch.int32, device=device)
    unread_r = torch.full((batch, pages - compressed - read_res), max(res_rows - 1, 0), dtype=torch.int32,
                          device=device)
    tables = [torch.cat([ids_c[i], unread_c, ids_r[i], unread_r], dim=1).contiguous() for i in range(copies)]
    return pool, tables


def cycling(tables: list[Any], launch: Callable[[Any], Any]) -> Callable[[], Any]:
    """A zero-argument call that runs ``launch(table)`` on each of ``tables`` in turn (those of
    :func:`cold_page_tables`, or anything a launch takes per call), with ``cycle`` set so that
    :func:`graph_time_ms` captures whole turns."""
    turn = itertools.count()

    def call() -> Any:
        return launch(tables[next(turn) % len(tables)])
    call.cycle = len(tables)
    return call


def do_bench_ms(fn: Callable[[], Any]) -> float:
    """triton.testing.do_bench's median: a short warm-up, then a Python launch per call."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=20))


def warm_replays(replay_ms: float, idle_s: float) -> int:
    """Untimed replays of a graph whose replay takes ``replay_ms`` before timing it, the timer having been idle
    ``idle_s`` seconds: enough for ``WARM_MS`` (at most ``MAX_WARM_REPLAYS``) after ``WARM_GAP_S`` or more, else
    none. None either for a replay of ``WARM_MS`` or more: a slow start then slows only the first of the timed
    replays, which their median leaves out, and an untimed one would cost a long prefill candidate a whole run."""
    if idle_s < WARM_GAP_S or replay_ms >= WARM_MS:
        return 0
    return min(MAX_WARM_REPLAYS, math.ceil(WARM_MS / max(replay_ms, 1e-3)))


def graph_time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph (do_bench where it cannot be)."""
    if not torch.cuda.is_available():
        return do_bench_ms(fn)
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            # Warm up on the capture stream: buffers a launch keeps per stream (split counters,
            # staging tables) are made here, outside the capture, and outlive the graph.
            for _ in range(2):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        once = max(start.elapsed_time(end), 1e-3)
        calls = max(1, min(MAX_CALLS, int(TARGET_MS / once)))
        # A whole number of turns through the input sets fn cycles over (cold_page_tables): every set used
        # equally often, and between two uses of one all the others pass.
        # A call of TARGET_MS or more runs alone: its own reads dwarf whatever L2 still holds, and whole turns
        # would multiply a long prefill candidate's cost by the cycle.
        # (fn.period: calls that belong together even then, e.g. the two lengths a decode bucket is timed at)
        cycle = max(1, int(getattr(fn, "cycle", 1) if once < TARGET_MS else getattr(fn, "period", 1)))
        calls = -(-max(calls, cycle) // cycle) * cycle
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    except Exception:  # not capturable (a host sync inside fn, an allocator limit): time it the old way
        # torch.cuda.graph restores the caller's stream only after a successful capture_end: when the
        # capture was invalidated, that raised first and left the capture stream current.
        torch.cuda.set_stream(caller)
        torch.cuda.synchronize()
        return do_bench_ms(fn)
    caller.wait_stream(stream)
    for _ in range(warm_replays(once * calls, time.monotonic() - _last_end[0])):
        graph.replay()
    times = []
    # A call of a millisecond or more is its own graph: a few replays are enough, and a long prefill
    # candidate then costs about what do_bench spent on it, not 11 of its runs.
    for _ in range(REPLAYS if calls > 1 else LONG_REPLAYS):
        # A graph replays on the stream current at replay(), not the one it was captured on: the
        # events go on that same stream, or they time nothing.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    _last_end[0] = time.monotonic()
    return float(sorted(times)[len(times) // 2])
