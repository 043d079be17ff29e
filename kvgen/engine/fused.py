"""The decoder's elementwise work as a few fused kernels: one launch where eager torch used five to ten.

Per layer the model runs four of these instead of ~15 small kernels
(float casts, neg/cat for RoPE, the v copy, separate adds and multiplies):

- :func:`qkv_rope`: the fused q|k|v GEMM output -> contiguous q, k, v with
  RoPE on q and k (and Qwen3's q/k RMSNorm first), cos/sin read per token's
  position from float32 tables;
- :func:`add_rms_norm`: residual add + RMSNorm (the residual updated);
- :func:`silu_mul`: ``silu(gate) * up`` from the fused gate|up GEMM output.

Which implementation runs follows the runtime's rule for its own kernels:
Triton on a CUDA device, Triton's CPU interpreter on the CPU when
``TRITON_INTERPRET`` is set (the kernels were built under it), plain torch
otherwise (a CPU without the interpreter, or other devices). Both compute
in float32 and round to the model dtype where Hugging Face's eager code
rounds. No function here synchronizes with the host or has a shape that
depends on data, so CUDA graphs capture them.
"""

from __future__ import annotations

import functools

import torch

from kvgen.runtime import env
from kvgen.runtime.env import triton_interpret as _interpreting  # the one reading of TRITON_INTERPRET

from . import pdl
from .kv_write import KVWrite

"""Environment switch: ``1`` runs the plain-torch versions everywhere (debugging, comparisons)."""


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The Triton kernels, decorated now (their interpreter mode is fixed at decoration); None if triton fails."""
    try:
        from . import fused_kernels
    except Exception:  # no usable triton: the torch versions run
        return None
    # imported earlier under the other mode: its kernels would run in the wrong place
    return fused_kernels if fused_kernels.INTERPRET == interpret else None


def _impl(x: torch.Tensor):
    """The Triton kernels module that runs for tensors like ``x``, or None for the torch versions (the rule:
    module docstring). One decision per call; the launchers take the module."""
    if env.fused_torch_only():
        return None
    interp = _interpreting()
    if x.device.type != ("cpu" if interp else "cuda"):
        return None
    return _kernels(interp)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``x`` (see the module docstring for the rule)."""
    return _impl(x) is not None


# The compile options of every launch here: FP fusion stated, as the generated kernels state it
# (templates/triton/launch_options.j2 says why; tests/test_compile_options.py holds the two equal).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def _pdl(x: torch.Tensor) -> dict:
    """A launch's PDL arguments (:mod:`.pdl`): the kernel's PDL constexpr and Triton's ``launch_pdl``, or none."""
    return {"PDL": True, "launch_pdl": True} if pdl.enabled(x) else {}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _rows_per_program(kernels, n_rows: int, row_elems: int, gpu_rows: int) -> int:
    """Rows per program: ``gpu_rows`` on a GPU; under the interpreter as many as fit 16K elements (fewer programs)."""
    if not kernels.INTERPRET:
        return gpu_rows
    return max(1, min(_pow2(n_rows), 16384 // row_elems))


# ---------------------------------------------------------------------------------------------- q/k/v + RoPE

def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             num_q_heads: int, num_kv_heads: int, head_dim: int,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             eps: float = 1e-6, write: KVWrite | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``qkv [T, (Hq + 2 Hkv) D]`` -> contiguous q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``, RoPE on q and k.

    ``positions [T]`` int64 index ``cos``/``sin`` (float32 ``[positions, D/2]``,
    rotate-half form: ``out[:D/2] = x1 c - x2 s``, ``out[D/2:] = x2 c + x1 s``).
    ``q_norm``/``k_norm`` (``[D]``, both or neither): per-head RMSNorm of q and
    k before RoPE (Qwen3). q, k and v are views of one new flat buffer of
    ``T (Hq + 2 Hkv) D`` elements; ``qkv`` is only read. Rows of ``qkv`` must
    be contiguous (any row stride).

    ``write`` (:class:`~.kv_write.KVWrite`): where the Triton kernel runs and the target fits, k and v go into
    the cache pages at their tokens' slots and come back as None (q alone in the buffer); elsewhere (the torch
    fallback) they come back as always, for the caller's write.
    """
    T = qkv.shape[0]
    Hq, Hkv, D = num_q_heads, num_kv_heads, head_dim
    if qkv.shape[1] != (Hq + 2 * Hkv) * D or qkv.stride(1) != 1 or D % 2:
        raise ValueError(f"qkv must be [T, {(Hq + 2 * Hkv) * D}] with contiguous rows and an even head_dim, "
                         f"got {list(qkv.shape)} (strides {qkv.stride()}), head_dim {D}")
    kernels = _impl(qkv) if T else None
    if write is not None and kernels is not None and write.fits(T, Hkv, D, qkv.dtype, qkv.device):
        buf = torch.empty(T * Hq * D, dtype=qkv.dtype, device=qkv.device)
        _qkv_rope_launch(kernels, qkv, buf, positions, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, write)
        return buf.view(T, Hq, D), None, None
    buf = torch.empty(T * (Hq + 2 * Hkv) * D, dtype=qkv.dtype, device=qkv.device)
    q = buf[:T * Hq * D].view(T, Hq, D)
    k = buf[T * Hq * D:T * (Hq + Hkv) * D].view(T, Hkv, D)
    v = buf[T * (Hq + Hkv) * D:].view(T, Hkv, D)
    if T == 0:
        return q, k, v
    if kernels is None:
        _qkv_rope_torch(qkv, positions, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, q, k, v)
        return q, k, v
    _qkv_rope_launch(kernels, qkv, buf, positions, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, None)
    return q, k, v


def _qkv_rope_launch(kernels, qkv, buf, positions, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, write) -> None:
    """One launch of the RoPE kernel into ``buf`` (q | k | v, or q alone with ``write``)."""
    half = D // 2
    half_pad = _pow2(half)
    T = qkv.shape[0]
    n_rows = T * (Hq + 2 * Hkv)
    block = _rows_per_program(kernels, n_rows, half_pad, max(1, 2048 // half_pad))
    norm = q_norm is not None
    kv = (buf, buf, positions, 0) if write is None else (write.k, write.v, write.slots, write.row_stride)
    kernels.qkv_rope_kernel[(_cdiv(n_rows, block),)](
        qkv, buf, positions, cos, sin, q_norm if norm else cos, k_norm if norm else cos,
        n_rows, T, qkv.stride(0), float(eps), *kv,
        HQ=Hq, HKV=Hkv, HALF=half, HALF_PAD=half_pad, BLOCK_R=block, QK_NORM=norm, num_warps=4,
        KV_PAGE=0 if write is None else write.page_size, **_pdl(qkv), **COMPILE_OPTIONS)


def _qkv_rope_torch(qkv, positions, cos, sin, Hq, Hkv, D, q_norm, k_norm, eps, q_out, k_out, v_out) -> None:
    T = qkv.shape[0]
    q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hkv, D)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin.index_select(0, positions).unsqueeze(1)
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x.float().chunk(2, dim=-1)
        out.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
    v_out.copy_(v.reshape(T, Hkv, D))


# ---------------------------------------------------------------------------------------------- RMSNorm

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm of the last dim: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (a new tensor)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: last dim {x.shape[-1]} != weight {weight.shape[0]}")
    x2 = x.reshape(-1, x.shape[-1])
    kernels = _impl(x)
    if x2.numel() == 0 or kernels is None or x2.stride(-1) != 1:
        h = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        return weight * h.to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(kernels, x2, None, out.view(x2.shape), weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry: ``residual = x + residual``; returns ``(rms_norm(residual), residual)``.

    ``x``, ``residual``: ``[T, N]`` with contiguous rows. ``residual=None``
    (the first layer): returns ``(rms_norm(x), x)``. The sum is rounded to
    the model dtype before the norm (as HF adds in the model dtype). With
    ``residual`` given, its storage is updated in place and ``x``'s storage
    holds the normed output: callers pass tensors they own and use only the
    returned ones afterwards.
    """
    if residual is None:
        return rms_norm(x, weight, eps), x
    kernels = _impl(x)
    if x.numel() == 0 or kernels is None or x.stride(-1) != 1 or residual.stride(-1) != 1:
        s = x + residual
        return rms_norm(s, weight, eps), s
    _launch_norm(kernels, x, residual, x, weight, eps)
    return x, residual


def _launch_norm(kernels, x: torch.Tensor, res: torch.Tensor | None, out: torch.Tensor, w: torch.Tensor,
                 eps: float) -> None:
    T, N = x.shape
    block_n = _pow2(N)
    block_t = _rows_per_program(kernels, T, block_n, 1)
    warps = 4 if block_n <= 2048 else (8 if block_n <= 8192 else 16)
    kernels.add_rms_norm_kernel[(_cdiv(T, block_t),)](
        x, x if res is None else res, out, w, T, N, x.stride(0), 0 if res is None else res.stride(0),
        out.stride(0), float(eps), HAS_RES=res is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=warps,
        **_pdl(x), **COMPILE_OPTIONS)


# ---------------------------------------------------------------------------------------------- SiLU * up

def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate | up halves of one GEMM output) -> a new ``silu(gate) * up`` ``[T, I]``."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    kernels = _impl(gate_up)
    if gate_up.numel() == 0 or kernels is None or gate_up.stride(1) != 1:
        gate, up = gate_up.split(inter, dim=-1)
        return torch.nn.functional.silu(gate) * up
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block_i = min(1024, _pow2(inter))
    block_t = _rows_per_program(kernels, T, block_i, 1)
    kernels.silu_mul_kernel[(_cdiv(T, block_t), _cdiv(inter, block_i))](
        gate_up, out, T, inter, gate_up.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_I=block_i, num_warps=4,
        **_pdl(gate_up), **COMPILE_OPTIONS)
    return out
