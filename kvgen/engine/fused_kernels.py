"""Triton kernels behind :mod:`kvgen.engine.fused` (imported lazily: only when a kernel first runs).

This module is imported on first use, never at package import, because
``triton.jit`` decides at decoration time whether a kernel runs on the CPU
interpreter (``TRITON_INTERPRET``), and kvgen's CLI sets that variable only
after it has parsed its arguments.

Every kernel loads in the model dtype, computes in float32 and rounds where
Hugging Face's eager code rounds (after the residual add, after the
normalization, after SiLU), so a bf16 model gives what HF gives up to the
order of a sum. All per-step sizes (token and row counts) are runtime ints
that Triton does not specialize on: a new batch never compiles a new binary
(CUDA graphs capture the same binaries the warm-up built).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvgen.runtime.env import triton_interpret

INTERPRET = triton_interpret()
"""Whether these kernels were decorated for the CPU interpreter (fixed at import)."""


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """A kernel launched with PDL (:mod:`kvgen.engine.pdl`): wait for the previous kernel's completion and writes
    (every kernel here reads step data from its first load on); the next kernel launches as this one's programs
    exit."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """A kernel launched with PDL (:mod:`kvgen.engine.pdl`): wait for the previous kernel's completion and writes
    (every kernel here reads step data from its first load on), then let the next kernel's blocks launch: they
    wait in turn for this one, so only their launch overlaps this short kernel's work."""
    _pdl_wait(PDL)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows", "n_tokens"])
def qkv_rope_kernel(qkv_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                    n_rows, n_tokens, stride_t, eps, kv_k_ptr, kv_v_ptr, slot_ptr, kv_row_stride,
                    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False,
                    KV_PAGE: tl.constexpr = 0):
    """Split a fused q|k|v GEMM output into contiguous q, k, v; RMSNorm (optional) and RoPE on q and k.

    Rows are (token, head) pairs of the fused output ``[T, (HQ+2*HKV)*D]``
    (row r: token r // NH, head r % NH; heads q first, then k, then v).
    ``out`` is one flat buffer holding q ``[T, HQ, D]``, then k and v
    ``[T, HKV, D]``. ``cos``/``sin`` are float32 ``[positions, D/2]``.
    KV_PAGE > 0 (write-through, :mod:`kvgen.engine.kv_write`): k and v go
    into the cache pages at each token's slot instead (token t's head h at
    ``((s // KV_PAGE) * HKV + h) * kv_row_stride + (s % KV_PAGE) * D`` of
    ``kv_k_ptr``/``kv_v_ptr``, ``s = slot[t]`` int64, negative: nowhere), and
    ``out`` holds q alone.
    """
    _pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HALF_PAD)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < HALF)[None, :]
    t = rows // (HQ + 2 * HKV)
    h = rows % (HQ + 2 * HKV)
    src = qkv_ptr + t.to(tl.int64)[:, None] * stride_t + (h * (2 * HALF))[:, None] + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    is_q = h < HQ
    rot = (h < HQ + HKV)[:, None]
    dt = out_ptr.dtype.element_ty
    if QK_NORM:
        # Qwen3's per-head RMSNorm before RoPE, rounded as HF rounds: weight * normed.to(dtype)
        rstd = 1.0 / tl.sqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)
        cmask = cols < HALF
        qw1 = tl.load(qw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        w1 = tl.where(is_q[:, None], qw1, kw1)
        w2 = tl.where(is_q[:, None], qw2, kw2)
        n1 = ((x1 * rstd[:, None]).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        n2 = ((x2 * rstd[:, None]).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        x1 = tl.where(rot, n1, x1)
        x2 = tl.where(rot, n2, x2)
    pos = tl.load(pos_ptr + t, mask=rmask, other=0).to(tl.int64)
    trig = pos[:, None] * HALF + cols[None, :]
    c = tl.where(rot, tl.load(cos_ptr + trig, mask=mask, other=1.0), 1.0)
    s = tl.where(rot, tl.load(sin_ptr + trig, mask=mask, other=0.0), 0.0)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    # destination: q block, then k block, then v block of the flat output
    t64 = t.to(tl.int64)
    is_k = (h >= HQ) & (h < HQ + HKV)
    D = 2 * HALF
    dst = tl.where(is_q, t64 * (HQ * D) + h * D,
                   tl.where(is_k, n_tokens * (HQ * D) + t64 * (HKV * D) + (h - HQ) * D,
                            n_tokens * ((HQ + HKV) * D) + t64 * (HKV * D) + (h - HQ - HKV) * D))
    optr = out_ptr + dst[:, None] + cols[None, :]
    if KV_PAGE > 0:  # q rows as above; k and v rows into the cache pages at their tokens' slots
        slot = tl.load(slot_ptr + t, mask=rmask, other=-1).to(tl.int64)
        live = slot >= 0
        slot = tl.where(live, slot, 0)
        live = live[:, None]
        at = ((slot // KV_PAGE) * HKV + tl.where(is_k, h - HQ, h - HQ - HKV)) * kv_row_stride + (slot % KV_PAGE) * D
        at = at[:, None] + cols[None, :]
        qmask = mask & is_q[:, None]
        kmask = mask & is_k[:, None] & live
        vmask = mask & (h >= HQ + HKV)[:, None] & live
        tl.store(optr, o1.to(dt), mask=qmask)
        tl.store(optr + HALF, o2.to(dt), mask=qmask)
        tl.store(kv_k_ptr + at, o1.to(dt), mask=kmask)
        tl.store(kv_k_ptr + at + HALF, o2.to(dt), mask=kmask)
        tl.store(kv_v_ptr + at, o1.to(dt), mask=vmask)
        tl.store(kv_v_ptr + at + HALF, o2.to(dt), mask=vmask)
    else:
        tl.store(optr, o1.to(dt), mask=mask)
        tl.store(optr + HALF, o2.to(dt), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def add_rms_norm_kernel(x_ptr, res_ptr, out_ptr, w_ptr, n_rows, N, stride_x, stride_r, stride_o, eps,
                        HAS_RES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """``res += x`` (when HAS_RES, then normalize res) and ``out = w * rmsnorm(x or res)``, rows of N.

    ``out`` may be ``x`` itself: each program reads its rows before writing them.
    """
    _pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dt)  # HF adds in the model dtype, then normalizes the rounded sum
        tl.store(res_ptr + r64 * stride_r + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = (x * rstd[:, None]).to(dt).to(tl.float32) * w
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(dt), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def silu_mul_kernel(gu_ptr, out_ptr, n_rows, inter, stride_gu, stride_o,
                    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr = False):
    """``out = silu(gate) * up`` where ``gu`` rows are ``[gate (inter) | up (inter)]``."""
    _pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < inter)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + r64 * stride_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r64 * stride_gu + inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # HF: silu in the model dtype, then the product
    tl.store(out_ptr + r64 * stride_o + cols[None, :], (a * u).to(dt), mask=mask)
