"""Decode kernel vs the scheme's reference (dequantize, then float64 attention).

The matrix is built from every registered scheme's capability declarations
(see ``harness.kernel_specs``): schemes x head_dim x GQA x page size x
sequence lengths x compute dtype. The default (CI) run takes a rotating cut
that covers every value of every axis at least once per scheme; the whole
product is ``-m slow``. Outputs are poisoned before every launch and every
pool starts as NaN / garbage, so a kernel that reads an unwritten slot, skips
a token or forgets a row fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.runtime import split_counters

from . import harness as hz
from .reference import reference_attention

HEAD_DIMS = (8, 64, 96, 128)
GQAS = (1, 4, 8)
PAGES = (16, 32)
AXES = {"head_dim": HEAD_DIMS, "gqa": GQAS, "page_size": PAGES, "lengths": hz.LENGTH_KINDS}


def run_decode(case: hz.Case, lengths, *, config=None, seed=0, window=0, softcap=0.0, q_scale=1.0,
               dev=None):
    """Build a cache, launch decode with a poisoned output, return (out, reference float64, cache, q)."""
    dev = dev or hz.device()
    cache, mod = hz.cache_and_kernel("decode", case, lengths, seed=seed, window=window, softcap=softcap, dev=dev)
    hq = case.num_kv_heads * case.gqa
    q = (hz.random_q(len(lengths), hq, case.head_dim, torch.float32, "cpu", seed=seed + 1) * q_scale)
    q = q.to(case.dtype).to(dev)
    out = hz.poisoned_like(q)
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, sm_scale,
               config=config)
    ref = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], window=window,
                              softcap=softcap, sm_scale=sm_scale)
    return out, ref, cache, q




@pytest.mark.parametrize("case", hz.kernel_specs(AXES, rotations=4))
def test_decode_matrix(case):
    lengths = hz.case_lengths(case)
    out, ref, *_ = run_decode(case, lengths)
    hz.check(case, out, ref, f"lengths {lengths}")


@pytest.mark.slow
@pytest.mark.parametrize("case", hz.kernel_specs(AXES, full=True))
def test_decode_matrix_full(case):
    lengths = hz.case_lengths(case)
    out, ref, *_ = run_decode(case, lengths)
    hz.check(case, out, ref, f"lengths {lengths}")


def _one_case(scheme: str, head_dim=64, gqa=4, page=16, dtype=None) -> hz.Case:
    s = hz.get_scheme(scheme)
    head_dim = hz.supported(s, "head_dim", (head_dim,))[0]
    page = hz.supported(s, "page_size", (page,))[0]
    dtype = dtype or hz.compute_dtypes()[-1]
    return hz.Case(scheme=scheme, head_dim=head_dim, gqa=gqa, page_size=page, compute_dtype=hz.dtype_name(dtype))


def _long_lengths(case: hz.Case) -> list[int]:
    """A ragged batch whose longest sequence spans several tiles, past the residual window."""
    P, w = case.page_size, hz.residual_window(case.scheme_obj)
    return [w + 6 * P + 5, 0, w + 2 * P, 2]


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("splits,ppt", [(2, 1), (5, 2), (11, 1)])
def test_decode_splits(scheme, splits, ppt):
    case = _one_case(scheme)
    lengths = _long_lengths(case)
    if splits > 8:  # more splits than one reduce chunk: needs as many pages
        lengths[0] = hz.residual_window(case.scheme_obj) + 11 * case.page_size - 3
    out, ref, *_ = run_decode(case, lengths, config={"num_splits": splits, "pages_per_tile": ppt})
    hz.check(case, out, ref, f"{splits} splits")


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("ppt", [2, 4])
def test_decode_multi_page_tiles(scheme, ppt):
    case = _one_case(scheme, head_dim=96, gqa=8, page=16, dtype=torch.float32 if hz.on_cpu() else None)
    out, ref, *_ = run_decode(case, _long_lengths(case), config={"num_splits": 1, "pages_per_tile": ppt}, seed=3)
    hz.check(case, out, ref, f"{ppt} pages per tile")


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_decode_sliding_window(scheme):
    case = _one_case(scheme, gqa=2)
    window = 2 * case.page_size + 5
    lengths = _long_lengths(case) + [window - 1, window + 1]
    out, ref, cache, q = run_decode(case, lengths, window=window, config={"num_splits": 3, "pages_per_tile": 1},
                                    seed=5)
    hz.check(case, out, ref, f"window {window}")
    # the window must matter: full attention gives a different answer
    full = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], sm_scale=case.head_dim ** -0.5)
    assert hz.rel_l2(full, ref) > 10 * hz.tolerance(case.scheme_obj, case.dtype)


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_decode_softcap(scheme):
    case = _one_case(scheme, gqa=4)
    softcap = 2.0
    # large logits so the cap bites
    lengths = _long_lengths(case)
    out, ref, cache, q = run_decode(case, lengths, softcap=softcap, q_scale=6.0,
                                    config={"num_splits": 2, "pages_per_tile": 2}, seed=7)
    hz.check(case, out, ref, f"softcap {softcap}")
    uncapped = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], sm_scale=case.head_dim ** -0.5)
    assert hz.rel_l2(uncapped, ref) > 10 * hz.tolerance(case.scheme_obj, case.dtype)


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_zero_length(scheme, splits):
    case = _one_case(scheme, gqa=4)
    P = case.page_size
    lengths = [0, hz.residual_window(case.scheme_obj) + P + 1, 0]
    out, ref, *_ = run_decode(case, lengths, config={"num_splits": splits, "pages_per_tile": 1}, seed=11)
    hz.check(case, out, ref, "length-0 rows")
    assert torch.equal(out[0].float().cpu(), torch.zeros_like(out[0].float().cpu()))
    assert torch.equal(out[2].float().cpu(), torch.zeros_like(out[2].float().cpu()))
    # an all-empty batch: zeros, no NaN
    out, *_ = run_decode(case, [0, 0], config={"num_splits": splits}, seed=12)
    assert torch.equal(out.float().cpu(), torch.zeros_like(out.float().cpu()))


@pytest.mark.parametrize("scheme", ["bf16" if not hz.on_cpu() else "fp16", "int4"])
def test_decode_split_arrival_counters_are_left_zero_and_reused(scheme):
    """The last split of each (sequence, KV head) combines the partials and zeroes its counter: launches
    of different batches and split counts back to back all stay exact, and no counter is left nonzero
    (a leftover count would make a later launch combine before every split has written)."""
    case = _one_case(scheme, gqa=4)
    w = hz.residual_window(case.scheme_obj)
    runs = [([w + 9 * case.page_size + 3, 5], 3), ([w + 2, w + 7 * case.page_size, 0, 40], 7),
            ([w + 9 * case.page_size + 3, 5], 2)]
    counters = None
    for i, (lengths, splits) in enumerate(runs):
        out, ref, cache, _ = run_decode(case, lengths, config={"num_splits": splits, "pages_per_tile": 1}, seed=20 + i)
        hz.check(case, out, ref, f"launch {i}: {splits} splits over {lengths}")
        mod = hz.load_op("decode", case.scheme, case.head_dim, case.num_kv_heads, case.gqa, case.page_size,
                         case.dtype, dev=hz.device())
        counters = [c for c in split_counters.buffers("decode") if c.device.type == out.device.type]
        assert counters and all(int(c.count_nonzero()) == 0 for c in counters)
        assert sum(c.numel() for c in counters) >= len(lengths) * case.num_kv_heads
    # counters owned by the caller (as a CUDA graph's are): used, left zero; too few is refused
    own = mod.split_counters(4, hz.device())
    lengths = runs[1][0]
    cache, _ = hz.cache_and_kernel("decode", case, lengths, seed=30, dev=hz.device())
    q = hz.random_q(len(lengths), case.num_kv_heads * case.gqa, case.head_dim, torch.float32, "cpu", seed=31)
    q = q.to(case.dtype).to(hz.device())
    args = (cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, case.head_dim ** -0.5)
    ref = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], sm_scale=case.head_dim ** -0.5)
    out = hz.poisoned_like(q)
    mod.launch(q, out, *args, config={"num_splits": 5, "pages_per_tile": 1}, counters=own)
    hz.check(case, out, ref, "caller's counters")
    assert int(own.count_nonzero()) == 0
    with pytest.raises(ValueError, match="counters"):
        mod.launch(q, hz.poisoned_like(q), *args, config={"num_splits": 5, "pages_per_tile": 1}, counters=own[:3])


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_decode_default_config_and_candidates(scheme):
    case = _one_case(scheme)
    mod = hz.load_op("decode", scheme, case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype)
    cfg = mod.default_config(4, 1000, hz.device())
    assert {"num_splits", "pages_per_tile", "num_warps", "num_stages"} <= set(cfg)
    cands = mod.candidates(4, 1000)
    assert cands and all(c["pages_per_tile"] * case.page_size >= 16 for c in cands)
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    # the heuristic: ~2 waves of SMs, capped by the tiles of the longest sequence
    sms = mod._num_sms
    try:
        mod._num_sms = lambda *a: 132
        big = mod.default_config(1, 131072, "cpu")
        assert big["num_splits"] == math.ceil(2 * 132 / case.num_kv_heads) or big["num_splits"] == mod.MAX_SPLITS
        assert mod.default_config(1, 16, "cpu")["num_splits"] == 1
        assert mod.default_config(256, 4096, "cpu")["num_splits"] == 1
    finally:
        mod._num_sms = sms
    # a candidate far from the default (most splits, largest tile) gives the reference answer
    lengths = _long_lengths(case)
    for c in (cands[-1],):
        out, ref, *_ = run_decode(case, lengths, config=c, seed=13)
        hz.check(case, out, ref, f"candidate {c}")


def test_decode_rejects_bad_inputs():
    case = _one_case("fp32")
    mod = hz.load_op("decode", "fp32", case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype)
    cache = hz.make_cache("fp32", case.head_dim, case.num_kv_heads, case.page_size, [5], case.dtype)
    q = hz.random_q(1, case.num_kv_heads * case.gqa, case.head_dim, case.dtype, hz.device())
    with pytest.raises(TypeError):
        mod.launch(q, torch.empty_like(q), cache.pools, cache.block_tables.long(), cache.seq_lens,
                   cache.num_compressed, 0.1)
    with pytest.raises(ValueError):
        mod.launch(q[:, :1], torch.empty_like(q[:, :1]), cache.pools, cache.block_tables, cache.seq_lens,
                   cache.num_compressed, 0.1)


# --------------------------------------------------------------------------- GPU (real sizes, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
def test_decode_gpu_real_size(scheme):
    hz.require_cuda()
    case = hz.gpu_case(scheme)
    lengths = [4096, 4096 - 7, 1, 2048 + 3]
    out, ref, cache, q = run_decode(case, lengths, dev="cuda")
    hz.check(case, out, ref, "default config")
    mod = hz.load_op("decode", scheme, case.head_dim, 8, 8, case.page_size, case.dtype, dev="cuda")
    cands = mod.candidates(len(lengths), 4096)
    # A spread of candidates on the same cache and reference (building those dominates at this size).
    for c in cands[:: max(1, len(cands) // 4)]:
        out = hz.poisoned_like(q)
        mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed,
                   1.0 / math.sqrt(case.head_dim), config=c)
        hz.check(case, out, ref, f"candidate {c}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
def test_decode_gpu_no_host_sync(scheme):
    hz.require_cuda()
    case = hz.gpu_case(scheme)
    lengths = [4096, 100, 0, 3000]
    cache = hz.make_cache(scheme, case.head_dim, 8, case.page_size, lengths, case.dtype, device="cuda")
    mod = hz.load_op("decode", scheme, case.head_dim, 8, 8, case.page_size, case.dtype, dev="cuda")
    q = hz.random_q(len(lengths), 64, case.head_dim, case.dtype, "cuda")
    out = torch.empty_like(q)
    args = (q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, case.head_dim ** -0.5)
    mod.launch(*args, config={"num_splits": 4, "pages_per_tile": 4})  # compile outside the check
    mod.launch(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mod.launch(*args, config={"num_splits": 4, "pages_per_tile": 4})
        mod.launch(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
