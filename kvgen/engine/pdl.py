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

- every one of them waits before its first x/step-data load: what
  overlaps is each launch and the previous kernel's tail (the GEMV issues
  its first chunk's weight loads around the wait; ptxas orders the wait
  first, but that peeled chunk is what lets it pipeline the loop: gemv.cu);
- who signals ``griddepcontrol.launch_dependents``, and when:
  - the GEMV and the small GEMM (:mod:`.small_gemm`, 5-64 rows), after
    their weight loops (not a q/k/v launch that writes the KV cache
    itself: the decode kernel after it launches as its programs exit, as
    it did after the cache write kernel);
  - the two short kernels whose next kernel is a projection, the fused
    residual-add + RMSNorm and SiLU * up, right after their wait: the
    projection's blocks launch during their few microseconds and wait
    there for their output;
  - the CUDA decode, when split, after its tile loops (its reduce kernel
    launches during the warps' merge), and that reduce kernel right after
    its wait (the o projection launches during it):
    templates/cuda/decode.cu.j2;
  - every other kernel implicitly, as its blocks exit.

  Measured on an H200 (Llama-3-8B shapes, ``benchmarks.engine``'s steps,
  benchmarks/results/2026-12-04-nvidia-h200): the early signal of the norm
  and SiLU kernels, with the peeled GEMV, took B=1 at 16K from 1.210x to
  1.153-1.168x of the roofline (int4 KV) and 1.139x to 1.093-1.096x
  (bf16), with B=32 at 2K unchanged (cuBLAS runs its projections; a kernel
  without the attribute ignores the signal). Signalling early in the
  attention path too (q/k/v RoPE, cache write, page quantize: the decode
  kernel's blocks then launch and wait during them) bought B=1 another
  0.5% but cost int4 at B=32 3.5%. Signalling at every kernel's start,
  the decode kernel's included, had cost bf16 5% at B=1: the o
  projection's blocks launched and sat on the SMs during attention
  (benchmarks/results/2026-12-03-nvidia-h200-6).

A kernel without the attribute keeps its full dependency whatever the one
before it signals, so PDL kernels mix freely with cuBLAS and torch's own.
``KVGEN_PDL=0`` launches everything plainly (comparisons); off CUDA, before
Hopper and under the interpreter nothing changes.

The projections (the GEMV and the small GEMM) may also ask L2 for their
first weight bytes before they wait: no kernel writes the weights, so a
program that launched during the previous kernel's tail can have them in
flight while it waits. An experiment, off unless ``KVGEN_PREFETCH_KB``
says how many KiB a program (a GEMV block, a small-GEMM program) asks for
(:func:`prefetch_bytes`); benchmarks/experiments/step_ab.py measures it.
Both switches are read by :mod:`kvgen.runtime.env`.
"""

from __future__ import annotations

import functools

import torch

# PREFETCH_SWITCH and prefetch_bytes are the projections' (small_gemm, gemv), re-exported beside enabled
from kvgen.runtime.env import PREFETCH_SWITCH, pdl_allowed, prefetch_bytes, triton_interpret  # noqa: F401


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` launches with PDL: a CUDA tensor on compute capability 9.0+, no Triton
    interpreter, and ``KVGEN_PDL`` unset or not ``0`` (read at each launch: a CUDA graph keeps what its capture
    launched)."""
    if not t.is_cuda or not pdl_allowed() or triton_interpret():
        return False
    return _hopper_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())

