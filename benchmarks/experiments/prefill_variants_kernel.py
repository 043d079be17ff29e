"""The Triton kernel of :mod:`benchmarks.experiments.prefill_variants` (an experiment, not the product's prefill):
one paged-prefill kernel whose constexpr flags turn on each variant the experiment compares (``FLAGS`` there;
:func:`launch` takes them as a dict). Its module docstring says what each flag does.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _exp2_16(x, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """exp2 of a 16-bit tensor by packed ex2.approx PTX (bf16x2 / f16x2); emulated in float32 without asm."""
    if USE_ASM:
        if IS_BF16:
            y = tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                          is_pure=True, pack=2)
    else:
        y = tl.exp2(x.to(tl.float32)).to(x.dtype)
    return y


@triton.jit
def _token_offsets(bt_row, start_n, kvh, bound, H: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PVEC: tl.constexpr):
    """Element offsets [BLOCK_N] (int64) of the first lane of each token start_n.. in the K/V pools.

    Baseline (the template): one block-table load per token, masked at `bound`. pvec: one load per page
    of the tile, broadcast over the page's tokens (masked only in masked tiles).
    """
    PPT: tl.constexpr = BLOCK_N // PAGE_SIZE
    if PVEC:
        pidx = start_n // PAGE_SIZE + tl.arange(0, PPT)
        if MASKED:
            page = tl.load(bt_row + pidx, mask=pidx * PAGE_SIZE < bound, other=0)
        else:
            page = tl.load(bt_row + pidx)
        pbase = (page.to(tl.int64) * H + kvh) * (PAGE_SIZE * HEAD_DIM)
        toff = tl.reshape(pbase[:, None] + (tl.arange(0, PAGE_SIZE) * HEAD_DIM)[None, :], [BLOCK_N])
        toff = tl.multiple_of(toff, HEAD_DIM)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_t = offs_n < bound
        page_id = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_t, other=0)
        base = page_id.to(tl.int64) * H + kvh
        toff = base * (PAGE_SIZE * HEAD_DIM) + (offs_n % PAGE_SIZE) * HEAD_DIM
    return toff


@triton.jit
def _load_tile(ptr, toff, start_n, bound, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PVEC: tl.constexpr, RT: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] K or V tile. Masked on tokens unless pvec's full tiles (the template masks every
    tile at its bound), on lanes only where BLOCK_D pads HEAD_DIM (a mask that varies along d would stop the
    loads from being vectorized)."""
    offs = toff[:, None] + offs_d[None, :]
    if MASKED or not PVEC:
        mask_t = (start_n + tl.arange(0, BLOCK_N)) < bound
        if BLOCK_D != HEAD_DIM:
            x = tl.load(ptr + offs, mask=mask_t[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptr + offs, mask=mask_t[:, None], other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            x = tl.load(ptr + offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptr + offs)
    if RT:
        x = x.to(tl.float32).to(ptr.dtype.element_ty)
    return x


@triton.jit
def _softmax_pv(s, v, acc, m_i, l_i, start_n, bound, pos, qk_scale, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, FOLD: tl.constexpr, ACCDOT: tl.constexpr, EXP16: tl.constexpr,
                EXP_ASM: tl.constexpr):
    """One tile's online-softmax update from its raw logits s = q k^T [ROWS, BLOCK_N]: (acc, m_i, l_i)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if FOLD:
        if MASKED:
            visible = (offs_n[None, :] < bound) & (offs_n[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        x = s * qk_scale - m_new[:, None]
    else:  # the template: scale the tile, then mask, max, subtract
        s = s * qk_scale
        if MASKED:
            visible = (offs_n[None, :] < bound) & (offs_n[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        x = s - m_new[:, None]
    alpha = tl.exp2(m_i - m_new)
    if EXP16:
        p = _exp2_16(x.to(v.dtype), v.dtype == tl.bfloat16, EXP_ASM)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    else:
        p32 = tl.exp2(x)
        l_i = l_i * alpha + tl.sum(p32, 1)
        p = p32.to(v.dtype)
    if ACCDOT:
        acc = acc * alpha[:, None]
        acc = tl.dot(p, v, acc)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_new, l_i


@triton.jit
def _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, start_n, kvh, bound, pos, offs_d, qk_scale,
          H: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, RT: tl.constexpr, FOLD: tl.constexpr,
          PVEC: tl.constexpr, ACCDOT: tl.constexpr, EXP16: tl.constexpr, EXP_ASM: tl.constexpr):
    """One unpipelined KV tile: load K and V, S = q K^T, online-softmax update."""
    toff = _token_offsets(bt_row, start_n, kvh, bound, H, PAGE_SIZE, HEAD_DIM, BLOCK_N, MASKED, PVEC)
    k = _load_tile(k_ptr, toff, start_n, bound, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, PVEC, RT)
    v = _load_tile(v_ptr, toff, start_n, bound, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, PVEC, RT)
    s = tl.dot(q, tl.trans(k))
    return _softmax_pv(s, v, acc, m_i, l_i, start_n, bound, pos, qk_scale, BLOCK_N, MASKED, FOLD, ACCDOT,
                       EXP16, EXP_ASM)


@triton.jit(do_not_specialize=["stride_bt"])
def prefill_variant_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, sm_scale,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RT: tl.constexpr, FOLD: tl.constexpr, PVEC: tl.constexpr, ACCDOT: tl.constexpr, PIPE: tl.constexpr,
    EXP16: tl.constexpr, EXP_ASM: tl.constexpr, WS: tl.constexpr, UNROLL: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_M * GP
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + b)
    qlen = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    m0 = block * BLOCK_M
    if m0 >= qlen:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    first_pos = seq_len - qlen

    rows = tl.arange(0, ROWS)
    tok = m0 + rows // GP
    head = kvh * G + rows % GP
    row_ok = tok < qlen
    if GP != G:
        row_ok = row_ok & (rows % GP < G)
    pos = first_pos + tok
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D != HEAD_DIM:
        mask_q = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    else:
        mask_q = row_ok[:, None]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask_q, other=0.0)

    # KV range [0, hi); every row sees the keys < full, so the whole tiles below `split` need no mask.
    hi = tl.minimum(seq_len, first_pos + tl.minimum(m0 + BLOCK_M, qlen))
    full = first_pos + m0 + 1
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)

    lim = tl.maximum(tl.minimum(hi, full), 0)
    split = (lim // BLOCK_N) * BLOCK_N
    if PIPE:
        # S of the next tile is issued before this tile's softmax and PV. Prologue: S of tile 0; epilogue:
        # softmax and PV of the last full tile. toff: the token offsets of the tile whose S is in flight
        # (its V is loaded with them one iteration later).
        if split > 0:
            toff = _token_offsets(bt_row, 0, kvh, split, H, PAGE_SIZE, HEAD_DIM, BLOCK_N, False, PVEC)
            k = _load_tile(k_ptr, toff, 0, split, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False, PVEC, RT)
            s_cur = tl.dot(q, tl.trans(k))
            for start_n in range(BLOCK_N, split, BLOCK_N):
                toff_next = _token_offsets(bt_row, start_n, kvh, split, H, PAGE_SIZE, HEAD_DIM, BLOCK_N, False,
                                           PVEC)
                k = _load_tile(k_ptr, toff_next, start_n, split, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False, PVEC,
                               RT)
                s_next = tl.dot(q, tl.trans(k))
                v = _load_tile(v_ptr, toff, start_n - BLOCK_N, split, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False,
                               PVEC, RT)
                acc, m_i, l_i = _softmax_pv(s_cur, v, acc, m_i, l_i, start_n - BLOCK_N, split, pos, qk_scale,
                                            BLOCK_N, False, FOLD, ACCDOT, EXP16, EXP_ASM)
                s_cur = s_next
                toff = toff_next
            v = _load_tile(v_ptr, toff, split - BLOCK_N, split, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, False, PVEC,
                           RT)
            acc, m_i, l_i = _softmax_pv(s_cur, v, acc, m_i, l_i, split - BLOCK_N, split, pos, qk_scale, BLOCK_N,
                                        False, FOLD, ACCDOT, EXP16, EXP_ASM)
    elif WS or UNROLL > 1:
        for start_n in tl.range(0, split, BLOCK_N, loop_unroll_factor=UNROLL, warp_specialize=WS):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, start_n, kvh, split, pos, offs_d,
                                  qk_scale, H, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, False, RT, FOLD, PVEC,
                                  ACCDOT, EXP16, EXP_ASM)
    else:
        for start_n in range(0, split, BLOCK_N):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, start_n, kvh, split, pos, offs_d,
                                  qk_scale, H, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, False, RT, FOLD, PVEC,
                                  ACCDOT, EXP16, EXP_ASM)
    # The diagonal tiles: causal and end-of-range mask.
    for start_n in range(split, hi, BLOCK_N):
        acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, start_n, kvh, hi, pos, offs_d,
                              qk_scale, H, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, True, RT, FOLD, PVEC,
                              ACCDOT, EXP16, EXP_ASM)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_q)


def _shape_constants(q, k_pool):
    """(H, G, GP, HEAD_DIM, BLOCK_D, PAGE) of a launch."""
    _, H, page, D = k_pool.shape
    G = q.shape[1] // H
    return H, G, triton.next_power_of_2(G), D, max(16, triton.next_power_of_2(D)), page


def launch(flags, cfg, q, out, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, max_q_len, sm_scale):
    """Run one variant: q, out [total_q, Hq, D] (unit last stride); k_pool, v_pool [num_pages, H, PAGE, D];
    block_tables int32 [B, max_pages]; seq_lens int32 [B]; cu_seqlens_q int32 [B+1]. Returns the compiled
    kernel (None under the interpreter)."""
    H, G, GP, D, BLOCK_D, page = _shape_constants(q, k_pool)
    block_m, kv = int(cfg["block_m"]), int(cfg["kv"])
    if block_m & (block_m - 1) or block_m * GP < 16 or kv % page or kv < 16 or (kv // page) & (kv // page - 1):
        raise ValueError(f"bad config {cfg}: block_m a power of two with block_m*GP >= 16, "
                         f"kv a power-of-two number of pages >= 16 tokens")
    assert q.stride(2) == 1 and out.stride(2) == 1 and block_tables.stride(1) == 1
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    opts = {} if INTERPRET else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
    grid = (triton.cdiv(int(max_q_len), block_m), seq_lens.shape[0], H)
    return prefill_variant_kernel[grid](
        q, out, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), float(sm_scale),
        H=H, G=G, GP=GP, HEAD_DIM=D, BLOCK_D=BLOCK_D, PAGE_SIZE=page, BLOCK_M=block_m, BLOCK_N=kv,
        RT=flags["rt"], FOLD=flags["fold"], PVEC=flags["pvec"], ACCDOT=flags["accdot"], PIPE=flags["pipe"],
        EXP16=flags["exp16"], EXP_ASM=flags["exp16"] and not INTERPRET, WS=flags["ws"],
        UNROLL=2 if flags["unroll2"] else 1, **opts)
