"""The Triton kernel behind :mod:`kvgen.engine.small_gemm` (imported lazily: only when it first runs).

Imported on first use, never at package import, because ``triton.jit``
decides at decoration time whether a kernel runs on the CPU interpreter
(``TRITON_INTERPRET``), which kvgen's CLI sets only after parsing its
arguments (as :mod:`kvgen.engine.fused_kernels`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvgen.runtime.env import triton_interpret

INTERPRET = triton_interpret()
"""Whether this kernel was decorated for the CPU interpreter (fixed at import)."""


@triton.jit(do_not_specialize=["m", "split_k"])
def small_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, m, n, k, stride_x, stride_out, split_k,
                      pos_ptr, cos_ptr, sin_ptr, stats_ptr, norm_w_ptr, n_stats, eps, kv_k_ptr, kv_v_ptr, slot_ptr,
                      kv_row_stride, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
                      GATED: tl.constexpr = False, ROPE_HQ: tl.constexpr = 0, ROPE_HKV: tl.constexpr = 0,
                      ROPE_HALF: tl.constexpr = 0,
                      RESIDUAL: tl.constexpr = False, NORM: tl.constexpr = False, STATS_PAD: tl.constexpr = 1,
                      PREFETCH: tl.constexpr = 0, KV_PAGE: tl.constexpr = 0):
    """``out[i, j] = sum_k x[i, k] w[j, k] (+ bias[j])`` for ``i < m <= BLOCK_M``: program (pid_n, pid_k) owns
    output columns ``[pid_n BLOCK_N, +BLOCK_N)`` and its share of k, a whole number of BLOCK_K blocks.

    Computed transposed, ``out^T = w x^T``: the weight tile is the dot's M (64 or 128 rows fill a Hopper
    warpgroup MMA) and the few rows of x its N, so no MMA row is padding. The weight tiles stream through the
    software pipeline once (evict-first); x, small and read by every program, stays in L2.

    SPLIT (``split_k`` > 1 programs along the grid's second axis): each program writes its float32 partial
    ``[BLOCK_M, BLOCK_N]`` to ``part_ptr`` (one slot per (pid_k, pid_n)), then counts itself in on the column
    block's arrival counter; the last to arrive sums the partials in split order (the result does not depend on
    arrival order), writes the output and zeroes the counter for the next launch (:mod:`.small_gemm` says which
    launches may share counters). No second kernel, no memset.
    Contract (the launcher checks it): k % BLOCK_K == 0, w row-major ``[n, k]``, x rows unit-stride in k.

    GATED (a gate|up projection): w is ``[2n, k]``, gate rows then up rows, and
    ``out[i, j] = silu(gate[i, j]) * up[i, j]`` for ``j < n``. A program's BLOCK_N weight rows are then
    BLOCK_N/2 gate rows and the up rows of the same columns, one tile for the dot as before, and it writes
    BLOCK_N/2 output columns: the decode step runs no separate SiLU kernel (and does not write and re-read
    the ``[m, 2n]`` gate|up output). Rounded where Hugging Face's eager MLP rounds (:func:`_finish`).

    ROPE_HQ > 0 (a q|k|v projection of ROPE_HQ query and ROPE_HKV key/value heads of 2 ROPE_HALF dims, w
    ``[(HQ + 2 HKV) D, k]``): a program's BLOCK_N rows are BLOCK_N/2 dims of one head's first half and the same
    dims of its second half, the pairs RoPE rotates together; it rotates q and k by ``cos``/``sin`` (float32
    ``[positions, HALF]``) at each row's ``pos`` and stores q ``[m, HQ, D]``, then k and v ``[m, HKV, D]``, into
    one flat ``out`` -- what :func:`kvgen.engine.fused.qkv_rope` makes of the plain projection, rounded as it
    rounds (:func:`_finish_rope`), with no kernel of its own. ``n`` is unused then. KV_PAGE > 0 (write-through):
    k and v go straight into the KV cache's pages instead of ``out`` (which then holds q alone) -- the token of row
    i, KV head h, at ``((s // KV_PAGE) * ROPE_HKV + h) * kv_row_stride + (s % KV_PAGE) * D`` of ``kv_k_ptr`` /
    ``kv_v_ptr`` for its slot ``s = slot[i]`` (int64; rows with a negative slot store nothing): the cache write
    runs as no kernel of its own either.

    RESIDUAL (a plain projection whose output a pre-norm block adds into the residual stream): ``out`` is that
    stream ``[m, n]``, read and updated in place, ``out = out + (x w^T + bias)`` with the projection rounded to the
    model dtype first and the sum rounded again (Hugging Face adds in the model dtype); the program also stores its
    columns' sum of the squared (rounded) sums, float32 ``stats[pid_n, i]`` ``[n blocks, BLOCK_M]``, what the next
    projection's NORM needs: the residual add + RMSNorm runs as no kernel of its own.

    NORM (the projection of an RMSNorm's output, ``x`` the residual stream itself): ``stats`` holds ``n_stats``
    (<= STATS_PAD) column blocks' sums of squares of each row of x (a RESIDUAL launch's), ``norm_w`` the norm's
    weight ``[k]``; each x tile is normalized on its way to the dot, ``(x rstd).to(dtype) * norm_w`` rounded as
    Hugging Face's RMSNorm rounds, with ``rstd = 1/sqrt(sum / k + eps)``. The sums come from the blocks in a fixed
    order, so a row's result does not depend on timing (nor on the other rows).

    PDL (launched with programmatic dependent launch, :mod:`kvgen.engine.pdl`): the program computes its indices,
    then waits for the previous kernel before its first load of x or stats. PREFETCH > 0 (with PDL): before that
    wait it asks L2 for its first PREFETCH k blocks of weight rows (:func:`_prefetch_l2`), which no kernel writes,
    so a program that launches during the previous kernel's tail finds them there.

    The strides are specialized (Triton learns that a row stride is a multiple of 16 elements): with x's row
    stride unspecialized it loaded x two bytes at a time, synchronously (LDG + STS, no cp.async), and the
    kernel read the weights at 0.3-0.8 of the copy bandwidth instead of 0.7-0.97 (H200, 2026-12-04;
    tests/engine/test_small_gemm_sm90.py keeps the loop's loads asynchronous).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    if ROPE_HQ > 0:
        # tile row r < BLOCK_N/2: dim d(r) of the head's first half; the rest: the same dims of its second half
        subs = ROPE_HALF // (BLOCK_N // 2)
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        dims = (pid_n % subs) * (BLOCK_N // 2) + half + (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * ROPE_HALF
        n_ok = half >= 0  # every row is real (the name is still bound: Triton resolves the calls below)
        rows = ((pid_n // subs) * (2 * ROPE_HALF) + dims).to(tl.int64)
    elif GATED:
        # tile row r < BLOCK_N/2: gate row of output column c(r); the rest: the up rows of the same columns
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        cols = pid_n * (BLOCK_N // 2) + half
        n_ok = cols < n
        rows = tl.where(n_ok, cols + (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * n, 0).to(tl.int64)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # rows past n read row 0 (computed, never stored): no load mask
    blocks = k // BLOCK_K
    per_split = tl.cdiv(blocks, split_k)
    b_lo = pid_k * per_split
    b_hi = tl.minimum(b_lo + per_split, blocks)
    w_rows = w_ptr + rows[:, None] * k
    if PDL:
        if PREFETCH > 0:
            # the weights are no kernel's output: ask L2 for the first of them while the previous kernel finishes
            _prefetch_l2(w_rows, b_lo, b_hi, BLOCK_K, PREFETCH)
        # x (and NORM's stats) are the previous kernel's output: wait for its completion and writes before the
        # first load
        tl.extra.cuda.gdc_wait()
    if NORM:
        # every column block's sum of squares of each row, summed in block order: one tile, one reduction
        parts = tl.arange(0, STATS_PAD)
        ss = tl.load(stats_ptr + parts[:, None] * BLOCK_M + offs_m[None, :],
                     mask=(parts < n_stats)[:, None] & m_ok[None, :], other=0.0)
        # rows past m (x reads row 0 there, never stored) as zeros: no overflow in their padding lanes
        rstd = tl.where(m_ok, 1.0 / tl.sqrt(tl.sum(ss, axis=0) / k + eps), 0.0)
    x_rows = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if NORM:
        # the norm weight's k block, loaded one iteration ahead: too small for the pipeline's asynchronous copies,
        # and a load waited for in its own iteration would stall every k step
        k_end = b_hi * BLOCK_K
        gain_next = tl.load(norm_w_ptr + b_lo * BLOCK_K + offs_kb, mask=b_lo * BLOCK_K + offs_kb < k_end, other=0.0)
    for b in range(b_lo, b_hi):
        kk = b * BLOCK_K + offs_kb
        w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        xt = tl.load(x_rows + kk[None, :])
        if NORM:
            gain = gain_next.to(tl.float32)
            gain_next = tl.load(norm_w_ptr + BLOCK_K + kk, mask=BLOCK_K + kk < k_end, other=0.0)
            xt = ((xt.to(tl.float32) * rstd[:, None]).to(xt.dtype).to(tl.float32) * gain[None, :]).to(xt.dtype)
        acc = tl.dot(w, tl.trans(xt), acc)
    if PDL and KV_PAGE == 0:
        # the weights are read: the next kernel's programs may launch (and wait for this one's completion). Not
        # when this launch writes the KV cache: the next kernel is then the decode, whose blocks launched early
        # cost int4 3.5% a step at B=32 (kvgen/engine/pdl.py); they launch as this launch's programs exit, as
        # they did after the cache write kernel this launch replaces.
        tl.extra.cuda.gdc_launch_dependents()
    if not SPLIT:
        if ROPE_HQ > 0:
            _finish_rope(acc, bias_ptr, rows, out_ptr, offs_m, m_ok, m, pid_n, pos_ptr, cos_ptr, sin_ptr, kv_k_ptr,
                         kv_v_ptr, slot_ptr, kv_row_stride, HAS_BIAS, BLOCK_M, BLOCK_N, ROPE_HQ, ROPE_HKV, ROPE_HALF,
                         KV_PAGE)
        else:
            _finish(acc, bias_ptr, rows, n_ok, n, out_ptr, stride_out, offs_m, m_ok, pid_n, stats_ptr, HAS_BIAS,
                    BLOCK_M, BLOCK_N, GATED, RESIDUAL)
    else:
        n_blocks = tl.num_programs(0)
        tile = offs_m[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, BLOCK_M] in a slot
        slot = BLOCK_M * BLOCK_N
        tl.store(part_ptr + (pid_k * n_blocks + pid_n).to(tl.int64) * slot + tile, acc)
        # Count this split in: the barrier orders every thread's stores before the (one-thread) release; the
        # last program reads the partials through L2 (.cg), where the other SMs' stores landed.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(split_k):
                total += tl.load(part_ptr + (s * n_blocks + pid_n).to(tl.int64) * slot + tile, cache_modifier=".cg")
            if ROPE_HQ > 0:
                _finish_rope(total, bias_ptr, rows, out_ptr, offs_m, m_ok, m, pid_n, pos_ptr, cos_ptr, sin_ptr,
                             kv_k_ptr, kv_v_ptr, slot_ptr, kv_row_stride, HAS_BIAS, BLOCK_M, BLOCK_N, ROPE_HQ,
                             ROPE_HKV, ROPE_HALF, KV_PAGE)
            else:
                _finish(total, bias_ptr, rows, n_ok, n, out_ptr, stride_out, offs_m, m_ok, pid_n, stats_ptr,
                        HAS_BIAS, BLOCK_M, BLOCK_N, GATED, RESIDUAL)
            tl.store(counter_ptr + pid_n, 0)


@triton.jit
def _prefetch_l2(w_rows, b_lo, b_hi, BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr):
    """Ask L2 for k blocks ``[b_lo, min(b_lo + BLOCKS, b_hi))`` of the weight rows ``w_rows`` (pointers ``[BLOCK_N,
    1]`` to each row's start): one ``prefetch.global.L2`` per 128-byte line, nothing waited for or returned. A
    line past the range is the row's first instead (a repeat, never an address outside the rows). BLOCKS a power
    of two, BLOCK_K elements a whole number of lines."""
    LINE: tl.constexpr = 128 // (w_rows.dtype.element_ty.primitive_bitwidth // 8)
    offs = b_lo * BLOCK_K + tl.arange(0, BLOCKS * BLOCK_K // LINE) * LINE
    ptrs = w_rows + tl.where(offs < tl.minimum(b_lo + BLOCKS, b_hi) * BLOCK_K, offs, 0)[None, :]
    # not pure: the prefetches have no result anyone reads, and must not be dropped as dead code
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A paired tile's ``acc [BLOCK_N, BLOCK_M]`` as its first and second halves of rows, ``[BLOCK_N/2, BLOCK_M]``
    each."""
    return tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))


@triton.jit
def _finish(acc, bias_ptr, rows, n_ok, n, out_ptr, stride_out, offs_m, m_ok, pid_n, stats_ptr, HAS_BIAS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """Store a program's summed ``acc [BLOCK_N, BLOCK_M]`` (``out^T``) with its bias: as it stands; GATED,
    ``silu(gate) * up`` of its two halves -- the gate and up outputs rounded to the model dtype first, then the
    SiLU, then the product, as Hugging Face's eager MLP (and :func:`kvgen.engine.fused.silu_mul`) round; or
    RESIDUAL, added to ``out`` (rounded, then the sum rounded) with its columns' sums of squares to ``stats``."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if GATED:
        gate, up = _halves(acc, BLOCK_M, BLOCK_N)
        gate = gate.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        y = act * up.to(dt).to(tl.float32)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + cols[:, None], y.to(dt),
                 mask=(cols < n)[:, None] & m_ok[None, :])
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_out + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
        y = acc.to(dt)
        if RESIDUAL:
            y = (y.to(tl.float32) + tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)).to(dt)
            h = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(stats_ptr + pid_n * BLOCK_M + offs_m, tl.sum(h * h, axis=0))
        tl.store(ptrs, y, mask=mask)


@triton.jit
def _finish_rope(acc, bias_ptr, rows, out_ptr, offs_m, m_ok, m, pid_n, pos_ptr, cos_ptr, sin_ptr, kv_k_ptr, kv_v_ptr,
                 slot_ptr, kv_row_stride, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, KV_PAGE: tl.constexpr):
    """Store a q|k|v program's ``acc [BLOCK_N, BLOCK_M]``: its two halves are dims ``d`` and ``d + HALF`` of one
    head. Rounded to the model dtype (the projection's output), then q and k rotated in float32 and rounded again,
    as :func:`kvgen.engine.fused_kernels.qkv_rope_kernel` does with the projection's rounded output; v as it is.
    KV_PAGE > 0: k and v heads to their slots' cache pages (the kernel's docstring), q to ``out``."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
    x1, x2 = _halves(acc, BLOCK_M, BLOCK_N)
    x1 = x1.to(dt).to(tl.float32)
    x2 = x2.to(dt).to(tl.float32)
    subs = HALF // (BLOCK_N // 2)
    h = pid_n // subs
    d = (pid_n % subs) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    trig = pos[None, :] * HALF + d[:, None]
    rot = h < HQ + HKV
    c = tl.where(rot, tl.load(cos_ptr + trig, mask=m_ok[None, :], other=1.0), 1.0)
    s = tl.where(rot, tl.load(sin_ptr + trig, mask=m_ok[None, :], other=0.0), 0.0)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    D: tl.constexpr = 2 * HALF
    t64 = offs_m.to(tl.int64)
    # q block, then k block, then v block of the flat output (qkv_rope_kernel's layout)
    base = tl.where(h < HQ, t64 * (HQ * D) + h * D,
                    tl.where(h < HQ + HKV, m * (HQ * D) + t64 * (HKV * D) + (h - HQ) * D,
                             m * ((HQ + HKV) * D) + t64 * (HKV * D) + (h - HQ - HKV) * D))
    ptrs = out_ptr + base[None, :] + d[:, None]
    mask = m_ok[None, :]
    if KV_PAGE > 0:
        if h >= HQ:  # a k or v head: into the cache page of each row's slot (the cache write's layout)
            slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
            live = m_ok & (slot >= 0)
            slot = tl.where(live, slot, 0)
            kvh = tl.where(h < HQ + HKV, h - HQ, h - HQ - HKV)
            at = ((slot // KV_PAGE) * HKV + kvh) * kv_row_stride + (slot % KV_PAGE) * D
            if h < HQ + HKV:
                ptrs = kv_k_ptr + at[None, :] + d[:, None]
            else:
                ptrs = kv_v_ptr + at[None, :] + d[:, None]
            mask = live[None, :]
    tl.store(ptrs, o1.to(dt), mask=mask)
    tl.store(ptrs + HALF, o2.to(dt), mask=mask)
