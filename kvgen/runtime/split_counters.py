"""Arrival counters of split launches: the last block of a group to arrive combines the group's partial results.

Owners keep apart (``owner``): the decode kernels and the engine's small GEMM. A split decode counts each of a
sequence's splits in on one int32 per (sequence, KV head), and the split that arrives last combines the partial
outputs and zeroes the counter for the next launch. Launches on one stream run in order, so one buffer per (device,
stream) serves them all without a memset (:func:`arrival_counters`); launches on two streams at once get separate
buffers. A CUDA graph keeps the address it was captured with, so a graph's owner passes counters of its own instead
(:func:`owned_counters`, e.g. the engine's decode graphs).
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept: a captured CUDA graph may still point at one


def arrival_counters(device: torch.device, n: int, owner: str = "decode", minimum: int = 256) -> torch.Tensor:
    """Zeroed int32 arrival counters, at least ``n`` (and ``minimum``), for ``owner``'s launches on ``device``'s
    current stream (each owner, e.g. the decode kernels or the engine's small GEMM, has its own buffers: its launches
    are the ones that must not overlap in their counter accesses).

    The buffer only grows (a larger one is allocated zeroed); an outgrown one is never freed, since a graph captured
    with it would otherwise count into reused memory. Doubling bounds the kept memory by the final size. None is
    made during a CUDA graph capture (its zeroing would run only when that graph replays): a capture must follow a
    warm-up of the same calls on its stream, and raises RuntimeError otherwise."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (owner, device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kvgen's {owner} kernel needs its arrival counters before a CUDA graph capture: run "
                               "the captured calls once on the capture stream first (a warm-up)")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 2 * (0 if buf is None else buf.numel()), minimum), dtype=torch.int32,
                          device=device)
        _COUNTERS[key] = buf
    return buf


def buffers(owner: str) -> list[torch.Tensor]:
    """``owner``'s current per-stream buffers (tests check that launches leave them zero)."""
    return [t for k, t in _COUNTERS.items() if k[0] == owner]


def owned_counters(batch: int, heads: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 counter buffer for launches of up to ``batch`` sequences of ``heads`` KV heads, owned by the
    caller (a CUDA graph keeps its address: its owner keeps the buffer as long as the graph). Every launch leaves it
    zero."""
    return torch.zeros(max(1, int(batch)) * int(heads), dtype=torch.int32, device=device)


__all__ = ["arrival_counters", "buffers", "owned_counters"]
