"""Programmatic dependent launch (PDL) for the engine's own kernels: whether a launch may overlap the one before it.

A decode step at batch 1 is some 350 short kernels in a row; between two of
them the GPU drains the first, flushes its writes and only then starts the
second, and the second's loads take a microsecond to arrive. With PDL
(Hopper and newer) a kernel launched with the programmatic-serialization
attribute may start while its predecessor is still running; it must then
wait (``griddepcontrol.wait``) for that predecessor's completion and memory
flush before it reads anything a predecessor wrote or writes anything at
all. kvgen's PDL kernels keep one contract, so that any chain of them is
equivalent to plain stream order:

- every one of them waits before its first load: what overlaps is each
  launch and the previous kernel's tail. (A GEMV that issued its first
  weight loads before the wait compiled to the same order: ptxas put the
  wait first; offline SASS, nvcc 13.);
- only the GEMV signals ``griddepcontrol.launch_dependents``, after its
  weight loop; every other kernel signals implicitly as its blocks exit.
  Signalling at every kernel's start was measured worse for bf16: a chain
  of kernels then launched ahead and sat waiting on the SMs during the
  attention kernel (B=1, 16K context on an H200: bf16 KV +5% a step, int4
  -3.5%; signalling late: -2.4% for both,
  benchmarks/results/2026-12-03-nvidia-h200-6).

A kernel without the attribute keeps its full dependency whatever the one
before it signals, so PDL kernels mix freely with cuBLAS and torch's own.
``KVGEN_PDL=0`` launches everything plainly (comparisons); off CUDA, before
Hopper and under the interpreter nothing changes.
"""

from __future__ import annotations

import functools
import os

import torch

from kvgen.runtime.env import triton_interpret

_SWITCH = "KVGEN_PDL"


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launches with PDL: a CUDA tensor on compute capability 9.0+, no Triton
    interpreter, and ``KVGEN_PDL`` unset or not ``0`` (read at each launch: a CUDA graph keeps what its capture
    launched)."""
    if not t.is_cuda or os.environ.get(_SWITCH, "1") in ("", "0") or triton_interpret():
        return False
    return _hopper_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())
