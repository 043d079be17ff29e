"""Small-batch projections: kvgen's CUDA GEMV (``gemv.cu``, 1-4 rows) or its Triton small GEMM (:mod:`.small_gemm`,
5-64 rows) where they beat cuBLAS, decided per weight shape and row bucket by timing.

A decode step at batch 1 is a pass over the weights, and cuBLAS reads the
small projections of a Llama-3-8B layer well below the copy bandwidth at
that size on an H200 (q/k/v at 0.76, o at 0.58 with a split-K reduce
kernel after it: 2026-12-03 engine profile). :func:`linear` is
``nn.functional.linear`` except for the shapes :func:`choose` found the
GEMV faster on: there, one to :data:`MAX_ROWS` rows of ``x`` run the GEMV
(and up to :data:`MAX_CHOICE_ROWS` rows the small GEMM, where it won).

:func:`choose` times, for each group of same-shaped weights of a model (the
layers' q/k/v, o, gate/up and down matrices, and the LM head) and each row
count the decode graphs capture up to :data:`MAX_CHOICE_ROWS`, cuBLAS against each GEMV (or small-GEMM) config in a
CUDA graph cycling over the group's weights (each call finds its weights
cold, as in a step), checks the winner against cuBLAS's output, and keeps
the faster; where the graphs launch the GEMV with PDL, cuBLAS must be faster
by :data:`PDL_CHAIN_MS`, what it costs the chain (:func:`prefers_gemv`).
Choices are per process and device, keyed by shape and dtype, and
remembered across starts (:mod:`.projection_store`: a later start on the
same GPU and versions checks them instead of timing); nothing else changes:
larger batches, other devices, the CPU and the interpreter run
``nn.functional.linear``. ``KVGEN_GEMV=0`` turns both kernels
off (comparisons); a missing nvcc with no library built before turns the GEMV off.

The library is built by the runtime's CUDA loader (nvcc, the build cache,
atomic writes) from ``gemv.cu`` beside this file, and launched through
ctypes on torch's current stream, so CUDA graphs capture it; on Hopper with
programmatic dependent launch (:mod:`.pdl`): it waits for the kernel that
wrote ``x`` before its loop and lets the next kernel start after it.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvgen.runtime import env

from . import fused, pdl, projection_store, small_gemm
from .kv_write import KVWrite

SOURCE = Path(__file__).with_name("gemv.cu")
ABI_VERSION = 3
MAX_ROWS = 4
"""The most rows of ``x`` the GEMV takes (the kernel is built for 1, 2 and up to 4)."""
MAX_CHOICE_ROWS = small_gemm.MAX_ROWS
"""The most rows of ``x`` for which :func:`choose` may pick a kernel of kvgen's (past the GEMV: the small GEMM)."""
CONFIGS = ("1 row x 8 vectors", "2 rows x 4 vectors", "4 rows x 2 vectors", "1 row x 4 vectors")
"""The kernel's configs by index (weight rows per warp x 16-byte vectors per lane in flight; gemv.cu)."""
PDL_CHAIN_MS = 0.004
"""What a projection costs a PDL decode step beyond its own time when cuBLAS runs it rather than the GEMV: cuBLAS
launches without the PDL attribute, so the chain drains before it and after it. The two are timed alone, one
projection after another; in the step, Llama-3-8B's gate/up projection at batch 1 timed 56.2-56.6 us by GEMV and
55.8-56.8 by cuBLAS, and the graphs running cuBLAS for it stepped 0.13-0.16 ms slower over its 32 layers, 4-5 us a
layer (H200, benchmarks/results/2026-12-03-nvidia-h200-7, recapture_step)."""
CHECK_REL_L2 = 1e-2
"""A GEMV result further than this from cuBLAS's (relative L2) is not used (a broken build, not rounding)."""
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_ARGTYPES = [_P, _P, _P, _P, _I32, _I32, _I32, _I64, _I64, _I32, _I32, _P, _I32, _I32]

_CHOICES: dict[tuple, int | small_gemm.Config] = {}
"""(device index, row bucket (:func:`_bucket`), N, K, dtype, has bias) -> what runs for it: a GEMV config (an
int) or a small-GEMM config; absent: cuBLAS."""


def enabled() -> bool:
    """Whether :func:`choose` may pick the GEMV (``KVGEN_GEMV`` unset or not ``0``)."""
    return env.gemv_allowed()


def _bucket(rows: int) -> int:
    """Rows as the kernel instance that runs them: 1, 2 or 4 (the GEMV's), else the small GEMM's BLOCK_M. An eager
    step of 3 rows takes the choice its graph bucket of 4 made (20 rows: the bucket of 32), and computes each row
    exactly as the graph does."""
    return 1 << (rows - 1).bit_length() if rows <= MAX_ROWS else small_gemm.row_block(rows)


def _key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return (x.device.index, _bucket(x.shape[0]), weight.shape[0], weight.shape[1], weight.dtype, bias is not None)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` takes these tensors (CUDA, 16-bit, 1..MAX_ROWS rows, K % 8 == 0, 16-byte aligned rows)."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS):
        return False
    K = weight.shape[1]
    if (x.dtype not in _DTYPES or weight.dtype != x.dtype or x.shape[1] != K or K % 8 or x.device != weight.device
            or weight.stride() != (K, 1) or x.stride(1) != 1 or x.stride(0) % 8 or not _aligned(x)
            or not _aligned(weight)):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.stride(0) == 1
                            and bias.device == x.device)


def _function(device: torch.device):
    from kvgen.runtime import cuda_loader

    return cuda_loader.load_function(SOURCE, device, "kvgen_gemv", _ARGTYPES, ABI_VERSION)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: int = 0) -> torch.Tensor:
    """``x [m, K] @ weight [N, K]^T (+ bias)`` -> a new ``[m, N]`` in ``x``'s dtype, by the GEMV kernel.

    float32 accumulation, rounded once. Raises ValueError for tensors it does not take (:func:`supports`)
    and the runtime's CudaBuildError when the kernel cannot be built or launched.
    """
    if not supports(x, weight, bias):
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows of 16-bit x [m, K] and weight [N, K] on one CUDA device, "
                         f"K % 8 == 0, contiguous 16-byte aligned rows; got x {list(x.shape)} {x.dtype} "
                         f"strides {x.stride()}, weight {list(weight.shape)} {weight.dtype} strides {weight.stride()}")
    if not 0 <= config < len(CONFIGS):
        raise ValueError(f"config must be 0..{len(CONFIGS) - 1}, got {config}")
    return _launch(x, weight, bias, config)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: int) -> torch.Tensor:
    """:func:`gemv` without its checks (the caller checked :func:`supports` and ``config``)."""
    m, (N, K) = x.shape[0], weight.shape
    out = torch.empty(m, N, dtype=x.dtype, device=x.device)
    chained = pdl.enabled(x)
    rc = _function(x.device)(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                             out.data_ptr(), m, N, K, x.stride(0), out.stride(0), _DTYPES[x.dtype], config,
                             torch.cuda.current_stream(x.device).cuda_stream, int(chained),
                             min(pdl.prefetch_bytes(), 1 << 30) if chained else 0)
    if rc:
        from kvgen.runtime import cuda_loader

        raise cuda_loader.launch_error(SOURCE, rc)
    return out


def _chosen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | small_gemm.Config | None:
    """What :func:`choose` picked for this projection at x's row bucket (a GEMV or small-GEMM config), else None."""
    if x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_CHOICE_ROWS and _CHOICES:
        return _CHOICES.get(_key(x, weight, bias))
    return None


@dataclass(frozen=True)
class DeferredNorm:
    """``rms_norm(hidden, norm.weight, norm.eps)`` not yet computed: the input of a projection that may normalize on
    the way in (the small GEMM's NORM). ``hidden`` is a pre-norm block's residual stream ``[m, H]`` as
    :func:`residual_linear` updated it, ``norm`` the RMSNorm with that launch's sums of squares. A projection that
    cannot take it runs the norm kernel first (:meth:`tensor`), which is what the model ran before."""

    hidden: torch.Tensor
    norm: small_gemm.Norm

    def tensor(self) -> torch.Tensor:
        """The normed rows, by the RMSNorm kernel (:func:`.fused.rms_norm`)."""
        return fused.rms_norm(self.hidden, self.norm.weight, self.norm.eps)


Input = torch.Tensor | DeferredNorm
"""A projection's input: rows, or rows whose RMSNorm is still to be applied (:class:`DeferredNorm`)."""


def _small_gemm_args(x: Input, weight: torch.Tensor, bias: torch.Tensor | None, **epilogue):
    """``(config, rows, norm)`` for a small-GEMM launch of this projection where :func:`choose` picked the small
    GEMM and it takes these tensors (a deferred norm applied on the way in), else None."""
    rows, norm = (x.hidden, x.norm) if isinstance(x, DeferredNorm) else (x, None)
    config = _chosen(rows, weight, bias)
    if not isinstance(config, small_gemm.Config):
        return None
    if not small_gemm.supports(rows, weight, bias, config, norm=norm, **epilogue):
        return None
    return config, rows, norm


FUSED_NORM = False
"""Whether :func:`residual_linear` may run: the residual add in the o/down small GEMM's epilogue and the RMSNorm in
the next projection's prologue. Off: measured on the H200 (2026-12-05, ``benchmarks.experiments.step_ab``, int4 KV,
Llama-3-8B, B=32 at 2K) the fused path cost 0.12-0.16 ms a step against the separate residual add + RMSNorm
kernel (likely because each q/k/v and gate/up program re-reads its rows' whole hidden state to normalize it),
and the engine step went from 5.51 to 5.38 ms (1.223x to 1.195x its roofline) with it off."""


def residual_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``residual += linear(x, weight, bias)`` in place by one small-GEMM launch, returning ``(residual, stats)``
    (the sums of squares a :class:`DeferredNorm` of it needs), where :func:`choose` picked the small GEMM for this
    projection and it takes these tensors; else None (the caller adds as before: :func:`.fused.add_rms_norm`).
    Rounded as Hugging Face rounds: the projection, then the sum, each to the model dtype. None whenever
    :data:`FUSED_NORM` is off."""
    if not FUSED_NORM:
        return None
    got = _small_gemm_args(x, weight, bias, residual=residual)
    if got is None:
        return None
    config, rows, _ = got
    return small_gemm.launch_supported(rows, weight, bias, config, residual=residual)


def linear(x: Input, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)``; the GEMV or the small GEMM where :func:`choose` picked it for this
    shape and row bucket. ``x`` a :class:`DeferredNorm`: of its normed rows (in the small GEMM's prologue where
    it runs, else after the norm kernel)."""
    if isinstance(x, DeferredNorm):
        got = _small_gemm_args(x, weight, bias)
        if got is not None:
            config, rows, norm = got
            return small_gemm.launch_supported(rows, weight, bias, config, norm=norm)
        x = x.tensor()
    config = _chosen(x, weight, bias)
    if config is not None:
        # one check of the tensors a call (chosen configs are valid ones), not one here and one in the kernel's
        # public function: an eager step makes some 200 of these calls
        if isinstance(config, small_gemm.Config):
            if small_gemm.supports(x, weight, bias, config):
                return small_gemm.launch_supported(x, weight, bias, config)
        elif supports(x, weight, bias):
            return _launch(x, weight, bias, config)
    return nn.functional.linear(x, weight, bias)


def gated_linear(x: Input, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of a gate|up projection (``weight [2I, K]``: gate rows, then up rows) -> ``[m, I]``.

    Where :func:`choose` picked the small GEMM for this shape and row bucket, one launch of it with the SiLU in
    its epilogue (``gated``); elsewhere :func:`linear` then :func:`.fused.silu_mul`. Both round as Hugging
    Face's eager MLP does. The choice is the plain projection's: the gated epilogue reads the same weight tiles
    and saves the SiLU kernel, so where the small GEMM beat cuBLAS alone it beats cuBLAS and the SiLU kernel.
    A :class:`DeferredNorm` ``x`` is normalized on the way in there (:func:`linear`)."""
    got = _small_gemm_args(x, weight, bias, gated=True)
    if got is not None:
        config, rows, norm = got
        return small_gemm.launch_supported(rows, weight, bias, config, gated=True, norm=norm)
    return fused.silu_mul(linear(x, weight, bias))


def qkv_rope_linear(x: Input, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, write: KVWrite | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``q, k, v`` of a q|k|v projection with RoPE on q and k, as :func:`.fused.qkv_rope` returns them for
    :func:`linear`'s output (no q/k norms: Qwen3's go through those two).

    Where :func:`choose` picked the small GEMM for this shape and row bucket and its column block holds whole
    rotation pairs, one launch of it with the rotation in its epilogue (:class:`.small_gemm.Rope`); elsewhere the
    projection, then the RoPE kernel. The choice is the plain projection's, as for :func:`gated_linear`; a
    :class:`DeferredNorm` ``x`` is normalized on the way in there (:func:`linear`).

    ``write`` (the layer's KV cache pages and the rows' slots): where that launch (or the RoPE kernel) takes it,
    k and v go straight into the cache and come back as None (the caller runs no cache write); elsewhere they
    come back as always."""
    rows = x.hidden if isinstance(x, DeferredNorm) else x
    if write is not None and not write.fits(rows.shape[0], num_kv_heads, head_dim, rows.dtype, rows.device):
        write = None  # a target neither kernel takes: k and v come back for the caller's write
    rope = small_gemm.Rope(num_q_heads, num_kv_heads, head_dim, positions, cos, sin, write)
    got = _small_gemm_args(x, weight, bias, rope=rope)
    if got is not None:
        config, rows, norm = got
        return small_gemm.launch_supported(rows, weight, bias, config, rope=rope, norm=norm)
    return fused.qkv_rope(linear(x, weight, bias), positions, cos, sin, num_q_heads, num_kv_heads, head_dim,
                          write=write)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided for one weight shape and row count (times in ms per call)."""

    name: str
    rows: int
    shape: tuple[int, int]
    cublas_ms: float
    gemv_ms: float | None  # the best of kvgen's kernel (the GEMV or the small GEMM, by rows); None: none passed
    config: int | small_gemm.Config | None  # None: cuBLAS runs

    def describe(self) -> str:
        kernel = "GEMV" if self.rows <= MAX_ROWS else "GEMM"
        ours = "n/a" if self.gemv_ms is None else f"{self.gemv_ms * 1e3:.1f} us"
        if self.config is None:
            who = "cuBLAS"
        elif isinstance(self.config, small_gemm.Config):
            who = f"GEMM ({self.config.describe()})"
        else:
            who = f"GEMV ({CONFIGS[self.config]})"
        return (f"{self.name} {self.shape[0]}x{self.shape[1]} at {self.rows} row(s): {who} "
                f"({kernel} {ours}, cuBLAS {self.cublas_ms * 1e3:.1f} us)")


def weight_groups(model: nn.Module) -> list[tuple[str, list[tuple[torch.Tensor, torch.Tensor | None]]]]:
    """The model's decode projections grouped by name: each layer's (weight, bias) of q/k/v, o, gate/up, down;
    the LM head (tied: the embedding)."""
    groups: dict[str, list] = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups["qkv"].append((attn.qkv_weight, attn.qkv_bias))
        groups["o"].append((attn.o_proj.weight, attn.o_proj.bias))
        groups["gate_up"].append((mlp.gate_up_weight, mlp.gate_up_bias))
        groups["down"].append((mlp.down_proj.weight, mlp.down_proj.bias))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    groups["lm_head"] = [(head, None)]  # one matrix, larger than L2 by itself at any useful vocabulary
    return [(name, pairs) for name, pairs in groups.items() if pairs]


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _checks_out(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a kernel's output is cuBLAS's up to rounding (a NaN anywhere never is)."""
    return _rel_l2(out, want) <= CHECK_REL_L2


def prefers_gemv(gemv_ms: float | None, cublas_ms: float, chained: bool) -> bool:
    """Whether the GEMV runs a projection timed at ``gemv_ms`` against cuBLAS's ``cublas_ms``: it is faster, or,
    in a PDL chain (``chained``: the decode graphs launch the GEMV with PDL), slower by less than
    :data:`PDL_CHAIN_MS`, what running cuBLAS there costs the step besides its own time."""
    if gemv_ms is None:
        return False
    return gemv_ms < cublas_ms + (PDL_CHAIN_MS if chained else 0.0)


def store(device: torch.device) -> projection_store.ProjectionStore | None:
    """Where :func:`choose` remembers its decisions on ``device`` across starts (:mod:`.projection_store`), keyed
    by everything they depend on besides the kernels' sources; None with the kernels off (``KVGEN_GEMV=0``), or,
    after one warning, when no store can be opened (the chooser then times, as without one)."""
    if not enabled():
        return None
    try:
        from kvgen.runtime.autotune import Autotuner

        constants = {"ABI_VERSION": ABI_VERSION, "CONFIGS": CONFIGS, "PDL_CHAIN_MS": PDL_CHAIN_MS,
                     "CHECK_REL_L2": CHECK_REL_L2, "TILES": small_gemm.TILES, "ROW_BLOCKS": small_gemm.ROW_BLOCKS,
                     "MIN_ROWS": small_gemm.MIN_ROWS}
        return projection_store.ProjectionStore(Autotuner(device, progress=False), constants)
    except Exception as exc:  # a bad KVGEN_AUTOTUNE, an unreadable source: remembering is an optimization
        warnings.warn(f"kvgen: the projection kernels' choices are not remembered this start "
                      f"({type(exc).__name__}: {exc}); they are timed", stacklevel=2)
        return None


def _recall(saved: projection_store.ProjectionStore | None, entry_key: str, runs: dict, x: torch.Tensor,
            w: torch.Tensor, b: torch.Tensor | None, want: torch.Tensor) -> tuple | None:
    """``(choice, cublas_ms, kvgen_ms)`` remembered for this projection and still good -- cuBLAS, or a config
    :func:`choose` offers today whose output here matches cuBLAS's --, else None (time it)."""
    if saved is None:
        return None
    choice, cublas_ms, ours = saved.recall(entry_key)
    if choice is projection_store.MISSING or (choice is not None and choice not in runs):
        return None
    if choice is not None:
        try:
            if not _checks_out(runs[choice](x, w, b), want):
                return None
        except Exception:  # a remembered config this build cannot run after all: timed afresh below
            return None
    return choice, cublas_ms, ours


def _time(pairs: list, x: torch.Tensor, m: int, runs: dict, want: torch.Tensor, skipped: list[str]) -> tuple:
    """``(choice, cublas_ms, kvgen_ms)`` for one projection group at ``m`` rows: cuBLAS and every config of
    ``runs`` whose output checks out, each timed over the group's weights (every call finds its weights cold:
    whole turns over the group's layers); the choice is None where cuBLAS keeps it (:func:`prefers_gemv`). A
    small-GEMM config that fails to build or run goes to ``skipped``."""
    from triton.runtime.errors import OutOfResources

    from kvgen.runtime.kernel_timer import cycling, graph_time_ms

    w0, b0 = pairs[0]
    cublas_ms = graph_time_ms(cycling(pairs, lambda wb: nn.functional.linear(x, *wb)))
    best, best_ms = None, None
    for config, run in runs.items():
        try:
            if not _checks_out(run(x, w0, b0), want):
                continue  # a broken build or config (or a NaN): never used
        except OutOfResources:
            continue  # a small-GEMM tile this GPU's shared memory does not hold after all
        except Exception as exc:  # a small-GEMM config Triton cannot build for this GPU: cuBLAS keeps it
            if m <= MAX_ROWS:
                raise
            skipped.append(f"{config.describe()}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ms = graph_time_ms(cycling(pairs, lambda wb, run=run: run(x, *wb)))
        if best_ms is None or ms < best_ms:
            best, best_ms = config, ms
    return (best if prefers_gemv(best_ms, cublas_ms, pdl.enabled(x)) else None), cublas_ms, best_ms


def choose(model: nn.Module, rows: Iterable[int], *, verbose: bool = False,
           saved: projection_store.ProjectionStore | None = None) -> list[Choice]:
    """Decide, per projection group of ``model`` and row bucket of ``rows`` (<= MAX_CHOICE_ROWS), kvgen's kernel
    (the GEMV up to MAX_ROWS rows, the small GEMM past them) or cuBLAS.

    Does nothing (returns []) off CUDA; without the GEMV's build (one warning) cuBLAS keeps the buckets of up
    to MAX_ROWS rows, and under TRITON_INTERPRET those past it; with ``KVGEN_GEMV=0`` it also forgets every
    earlier choice. Small-GEMM tiles whose stages exceed the GPU's shared memory are not timed, and a config
    that fails to build or run is skipped (one warning for all). Call it before CUDA graphs are captured over
    the model: captured calls keep what ran then. ``saved`` (:func:`store`): decisions remembered from an
    earlier start are used without timing once their output checks out, and new ones are remembered.
    """
    if not enabled():
        clear()  # choices an earlier model made in this process stop too
        return []
    buckets = sorted({_bucket(int(r)) for r in rows if 1 <= int(r) <= MAX_CHOICE_ROWS})
    groups = weight_groups(model)
    if not buckets or not groups:
        return []
    first = groups[0][1][0][0]
    if not first.is_cuda or first.dtype not in _DTYPES:
        return []
    from kvgen.runtime.cuda_loader import CudaBuildError

    if buckets[0] <= MAX_ROWS:
        try:
            _function(first.device)
        except CudaBuildError as exc:
            warnings.warn(f"kvgen: the small-batch GEMV is unavailable ({exc}); cuBLAS runs the projections of "
                          f"up to {MAX_ROWS} rows", stacklevel=2)
            buckets = [b for b in buckets if b > MAX_ROWS]
    from kvgen.runtime.env import triton_interpret

    if triton_interpret():  # Triton kernels run on the CPU here: the small GEMM cannot take CUDA tensors
        buckets = [b for b in buckets if b <= MAX_ROWS]
    props = torch.cuda.get_device_properties(first.device)
    shared_limit = getattr(props, "shared_memory_per_block_optin", None)
    started = time.perf_counter()
    recalled = 0
    decided: list[Choice] = []
    skipped: list[str] = []
    gen = torch.Generator(device=first.device).manual_seed(0)
    for name, pairs in groups:
        w0, b0 = pairs[0]
        for m in buckets:
            x = torch.randn(m, w0.shape[1], device=w0.device, dtype=w0.dtype, generator=gen)
            if m <= MAX_ROWS:
                ok = all(supports(x, w, b) for w, b in pairs)  # the same for every GEMV config
                runs = {c: functools.partial(gemv, config=c) for c in range(len(CONFIGS)) if ok}
            else:
                runs = {c: functools.partial(small_gemm.small_gemm, config=c)
                        for c in small_gemm.candidates(w0.shape[0], w0.shape[1], props.multi_processor_count, m,
                                                       shared_limit)
                        if all(small_gemm.supports(x, w, b, c) for w, b in pairs)}
            if not runs:
                continue
            key = _key(x, w0, b0)
            _CHOICES.pop(key, None)
            want = nn.functional.linear(x, w0, b0)
            entry_key = projection_store.key(name, tuple(w0.shape), w0.dtype, b0 is not None, m, pdl.enabled(x))
            got = _recall(saved, entry_key, runs, x, w0, b0, want)
            recalled += got is not None
            if got is None:
                failed = len(skipped)
                got = _time(pairs, x, m, runs, want, skipped)
                # a decision some candidate could not take part in (a build or launch failure) is not kept:
                # the next start tries them all again
                if saved is not None and len(skipped) == failed:
                    saved.remember(entry_key, *got)
            use, cublas_ms, best_ms = got
            if use is not None:
                _CHOICES[key] = use
            decided.append(Choice(name, m, tuple(w0.shape), cublas_ms, best_ms, use))
    if skipped:
        warnings.warn(f"kvgen: {len(skipped)} small-GEMM configs failed to build or run and were skipped, e.g. "
                      f"{skipped[0]}", stacklevel=2)
    if verbose and decided:
        used = [c for c in decided if c.config is not None]
        print(f"kvgen: kvgen's small-batch kernels for {len(used)} of {len(decided)} projection shapes "
              f"({recalled} remembered from an earlier start; {time.perf_counter() - started:.1f} s)"
              + (": " + "; ".join(c.describe() for c in used) if used else ""), file=sys.stderr)
    return decided


def clear() -> None:
    """Forget every choice (cuBLAS runs everywhere again); tests and benchmarks comparing the two."""
    _CHOICES.clear()
