"""Arrival counters for decode kernels that combine their splits in the kernel (Triton and CUDA alike).

A decode launch with ``num_splits > 1`` has each split write a partial output, then count itself in on
one int32 counter of its (sequence, KV head); the split that arrives last combines the partials and
resets the counter to zero. So a counter buffer is left zero by every launch and needs no memset
between launches: the contract both decode templates keep.

Two owners of such buffers:
- :func:`stream_counters`: one buffer per (device, stream), kept here, for eager launches (launches on
  one stream run in order; launches on two streams at once get separate buffers);
- :func:`owned_counters`: a buffer its caller keeps, for launches captured in a CUDA graph (the graph
  keeps the address it was captured with).
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept: a captured CUDA graph may still point at one


def stream_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, at least ``n``, for launches on ``device``'s current stream.

    The buffer only grows (a larger one is allocated zeroed); an outgrown one is never freed, since a
    graph captured with it would otherwise count into reused memory. Doubling bounds the kept memory
    by the final size.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 2 * (0 if buf is None else buf.numel()), 256), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def owned_counters(heads: int, batch: int, device) -> torch.Tensor:
    """A zeroed int32 counter buffer for launches of up to ``batch`` sequences of ``heads`` KV heads, owned by the caller.

    For launches captured in a CUDA graph: the graph keeps this buffer's address, so its owner keeps the
    buffer as long as the graph (and passes it as ``launch(..., counters=)``). Every launch leaves it zero.
    A decode module's ``split_counters(batch, device)`` is this function with its ``heads`` bound.
    """
    return torch.zeros(max(1, int(batch)) * int(heads), dtype=torch.int32, device=device)


def counters_for(counters: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The counters a launch of ``n`` (sequence, KV head) pairs on ``device`` uses: the caller's, checked, or the stream's."""
    if counters is None:
        return stream_counters(device, n)
    if counters.dtype != torch.int32 or counters.numel() < n or counters.device != device:
        raise ValueError(f"counters must be int32 with at least {n} elements on {device}, "
                         f"got {counters.dtype} x {counters.numel()} on {counters.device}")
    return counters
