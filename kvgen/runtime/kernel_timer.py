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
through :func:`cold_copies` distinct inputs (the runtime's synthetic block
tables, each a fresh draw of random pages): between two uses of one, about
``COLD_FACTOR`` L2 caches' worth of other pages are read. Measured on an
H200 (2026-12-02, benchmarks/results/2026-12-02-nvidia-h200-5): on warm
inputs the CUDA bf16 decode at the 64-dim anchor timed 0.0388 ms against
Triton's 0.0406 and was chosen, yet ran at 1.12x SDPA under do_bench's
cold L2 where Triton ran at 1.00-1.04x. ``fn`` must be capturable (no host synchronization); where capture fails the
timer falls back to do_bench. Off CUDA (the interpreter) it is do_bench too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

TARGET_MS = 1.0
"""Calls per graph are chosen so a replay lasts about this long (per-replay overhead below 1%)."""
MAX_CALLS = 200
REPLAYS = 11
LONG_REPLAYS = 3
COLD_FACTOR = 3
"""Between two uses of one input set, the timed calls read at least this many L2 caches' worth of others."""
MAX_COLD_COPIES = 64


def l2_bytes(device: torch.device | str) -> int:
    """The L2 cache's size in bytes on a CUDA ``device``; 0 elsewhere (nothing to keep cold)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def cold_copies(working_set_bytes: int, device: torch.device | str) -> int:
    """How many distinct input sets, each reading ``working_set_bytes``, timed calls should cycle through so
    that none is still in L2 when it comes round again: ``ceil(COLD_FACTOR * L2 / working set)``, at least 1
    (a working set of three L2s or more is cold by itself), at most ``MAX_COLD_COPIES``."""
    l2 = l2_bytes(device)
    if l2 <= 0 or working_set_bytes <= 0:
        return 1
    return max(1, min(MAX_COLD_COPIES, -(-COLD_FACTOR * l2 // int(working_set_bytes))))


def do_bench_ms(fn: Callable[[], Any]) -> float:
    """triton.testing.do_bench's median: a short warm-up, then a Python launch per call."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=20))


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
    return float(sorted(times)[len(times) // 2])
