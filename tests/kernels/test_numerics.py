"""Numerics contract of every scheme (issue 13, item 7), kernels vs the torch reference.

1. Non-finite K/V propagate: a NaN written into the cache makes the output of
   every query that attends to it NaN, under every scheme, exactly as over a
   float page (and as SDPA); an Inf written into a quantized page reads back as
   NaN (the scale of its token, or of its page's channel for KIVI keys, becomes
   NaN); on float pages an Inf follows IEEE arithmetic, as SDPA does. Never a
   silently finite output where the reference is non-finite, and the queries and
   sequences that do not attend to the token stay finite and correct.
2. Finite K/V representable in the compute dtype never produce NaN/Inf: values
   whose per-channel range exceeds 65,504 (which made KIVI's float16 decode path
   overflow) and values at float16's limit; past it (float32 compute), KIVI and
   nuq4 saturate, finite, as their references do.

Caches are written the way the runtime writes them: the cache_write kernel
(and page_quantize for residual schemes, whose every full page is converted
here), so the write-time arithmetic under test is the kernels', and the
reference is the scheme's quantize_page/dequantize_page of the same tokens.
Both decode and prefill (all keys from the pages) run on each cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.runtime.pools import allocate_pool

from . import harness as hz
from .reference import reference_attention

H, GQA, P = 2, 2, 16
DTYPES = ("float32", "float16")


def _is_float(scheme) -> bool:
    return scheme.name in ("fp32", "fp16", "bf16")


def build_cache(s, D: int, dtype: torch.dtype, ks: list[torch.Tensor], vs: list[torch.Tensor], dev: str):
    """Write per-sequence K/V ``[H, n, D]`` through the write kernels; return (cache tensors, seen K/V).

    Residual schemes: every token goes to the residual pool through cache_write,
    then page_quantize converts every full page (the residual window is the
    runtime's policy, not the kernels'; converting all full pages puts the
    poisoned tokens into compressed pages); the partial tail stays residual.
    ``seen`` is what the reference attends: quantize_page/dequantize_page of the
    compute-dtype tokens for compressed pages, the compute-dtype tokens otherwise.
    """
    residual = s.residual_tokens is not None
    lengths = [k.shape[1] for k in ks]
    n_pages = [-(-n // P) for n in lengths]
    n_comp = [n // P if residual else m for n, m in zip(lengths, n_pages)]
    total = sum(n_pages)
    pools = allocate_pool(hz.pool_descriptions(s, D, P), total + 1, H, dtype, "cpu", poison=True)
    if residual:
        pools.update(allocate_pool(hz.residual_descriptions(D, P), total + 1, H, dtype, "cpu", poison=True))
    pools = {n: t.to(dev) for n, t in pools.items()}
    write = hz.load_op("cache_write", s, D, H, GQA, P, dtype, dev=dev)
    bt = torch.full((len(ks), max(n_pages)), total, dtype=torch.int32)  # unused entries: the spare page
    src, dst, seen_k, seen_v = [], [], [], []
    pid = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        n = lengths[b]
        pages = list(range(pid, pid + n_pages[b]))
        pid += n_pages[b]
        slots = torch.tensor([pages[t // P] * P + t % P for t in range(n)], dtype=torch.int64)
        kc, vc = k.to(dtype), v.to(dtype)
        write.launch(kc.transpose(0, 1).contiguous().to(dev), vc.transpose(0, 1).contiguous().to(dev), pools,
                     slots.to(dev))
        kf, vf = kc.float(), vc.float()
        sk, sv = kf.clone(), vf.clone()
        for j, page in enumerate(pages):
            bt[b, j] = page
            lo, hi = j * P, min((j + 1) * P, n)
            if j < n_comp[b]:
                if residual:
                    src.append(page)
                    dst.append(page)
                dk, dv = s.dequantize_page(s.quantize_page(kf[:, lo:hi], vf[:, lo:hi]), D)
                sk[:, lo:hi], sv[:, lo:hi] = dk.float(), dv.float()
        seen_k.append(sk)
        seen_v.append(sv)
    if residual and src:
        convert = hz.load_op("page_quantize", s, D, H, GQA, P, dtype, dev=dev)
        convert.launch(pools, torch.tensor(src, dtype=torch.int32, device=dev),
                       torch.tensor(dst, dtype=torch.int32, device=dev))
    tensors = dict(pools=pools, block_tables=bt.to(dev),
                   seq_lens=torch.tensor(lengths, dtype=torch.int32, device=dev),
                   num_compressed=torch.tensor(n_comp, dtype=torch.int32, device=dev))
    return tensors, seen_k, seen_v


def run_both(s, D: int, dtype: torch.dtype, ks, vs, q_scale: float = 1.0, seed: int = 1):
    """Decode (last position) and prefill (every position, keys from the pages) over one kernel-written cache.

    Returns ``[(op, out, ref, positions)]``; ``positions[b]`` are sequence b's query positions.
    """
    dev = hz.device()
    c, seen_k, seen_v = build_cache(s, D, dtype, ks, vs, dev)
    lengths = [k.shape[1] for k in ks]
    sm_scale = 1.0 / math.sqrt(D)
    gen = torch.Generator().manual_seed(seed)
    hq = H * GQA
    results = []

    q = (torch.randn(len(ks), hq, D, generator=gen) * q_scale).to(dtype).to(dev)
    out = hz.poisoned_like(q)
    hz.load_op("decode", s, D, H, GQA, P, dtype, dev=dev).launch(
        q, out, c["pools"], c["block_tables"], c["seq_lens"], c["num_compressed"], sm_scale,
        config={"num_splits": 2, "pages_per_tile": 1})
    ref = reference_attention(q, seen_k, seen_v, [n - 1 for n in lengths], sm_scale=sm_scale)
    results.append(("decode", out.cpu(), ref, [[n - 1] for n in lengths]))

    total = sum(lengths)
    q = (torch.randn(total, hq, D, generator=gen) * q_scale).to(dtype).to(dev)
    out = hz.poisoned_like(q)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    positions = [list(range(n)) for n in lengths]
    hz.load_op("prefill", s, D, H, GQA, P, dtype, dev=dev).launch(
        q, out, c["pools"], c["block_tables"], c["seq_lens"], c["num_compressed"], cu, max(lengths), sm_scale,
        config={"block_m": 16, "pages_per_tile": 1})
    ref = reference_attention(q, seen_k, seen_v, positions, sm_scale=sm_scale)
    results.append(("prefill", out.cpu(), ref, positions))
    return results


def _rows(results_positions, b: int) -> slice:
    start = sum(len(p) for p in results_positions[:b])
    return slice(start, start + len(results_positions[b]))


# --------------------------------------------------------------------------- 1. non-finite K/V

# (what, KV head, token, channel, value); sequence b+1 gets poison b, sequence 0 stays clean.
POISON = [
    ("k", 0, 5, 3, float("nan")),
    ("v", 1, 5, 7, float("nan")),
    ("k", 0, 20, 1, float("inf")),
    ("v", 1, 20, 2, float("-inf")),
    ("k", 1, 2 * P + 2, 0, float("nan")),   # in the partial tail page (residual pool for KIVI and nuq4)
]
LENGTH = 2 * P + 3


# numpy (the interpreter) warns about the inf/nan arithmetic these inputs exist to provoke
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_non_finite_kv_propagates(scheme, dtype):
    s, dt, D = hz.get_scheme(scheme), hz.as_dtype(dtype), 64
    gen = torch.Generator().manual_seed(3)
    ks = [torch.randn(H, LENGTH, D, generator=gen) for _ in range(len(POISON) + 1)]
    vs = [torch.randn(H, LENGTH, D, generator=gen) for _ in range(len(POISON) + 1)]
    for b, (what, h, t, ch, val) in enumerate(POISON, start=1):
        (ks if what == "k" else vs)[b][h, t, ch] = val
    tol = hz.tolerance(s, dt)
    float_page = _is_float(s)
    for op, out, ref, positions in run_both(s, D, dt, ks, vs):
        assert not torch.isnan(out[_rows(positions, 0)]).any(), f"{op}: NaN leaked into a clean sequence"
        clean = [(_rows(positions, 0), slice(None))]
        for b, (what, h, t, ch, val) in enumerate(POISON, start=1):
            rows = _rows(positions, b)
            heads = slice(h * GQA, (h + 1) * GQA)
            other = slice((1 - h) * GQA, (2 - h) * GQA)
            clean.append((rows, other))
            sees = torch.tensor([p >= t for p in positions[b]])      # queries attending the poisoned token
            got = out[rows, heads][sees]
            want = ref[rows, heads][sees]
            what_id = f"{op}: {what}[head {h}, token {t}] = {val}"
            assert sees.any()
            # kernel and reference agree, query by query, on which outputs are finite
            assert torch.equal(torch.isfinite(got).all(-1), torch.isfinite(want).all(-1)), \
                f"{what_id}: kernel and reference disagree on which outputs are finite"
            if not (float_page and what == "k" and math.isinf(val)):
                # an Inf key on a float page may score -inf (weight 0), as in SDPA; everything else is non-finite
                assert not torch.isfinite(got).all(-1).any(), f"{what_id}: a query attending it came out finite"
            if not float_page:
                assert torch.isnan(got).any(-1).all(), f"{what_id}: quantized pages must read it back as NaN"
        for rows, heads in clean:
            got, want = out[rows, heads], ref[rows, heads]
            assert torch.isfinite(got).all(), f"{op}: non-finite output in a head or sequence without poison"
            err = hz.rel_l2(got, want)
            assert err <= tol, f"{op}: clean rows rel L2 {err:.2e} > {tol:.1e}"


# --------------------------------------------------------------------------- 2. large finite K/V


def _large(gen, n: int, D: int, spread: float, limit: float) -> torch.Tensor:
    """K/V of magnitude ~``spread``: channel ranges well past 65,504, entries at +-limit in a few channels."""
    x = (torch.randn(H, n, D, generator=gen) * spread).clamp(-limit, limit)
    x[:, ::2, 0] = limit
    x[:, 1::2, 0] = -limit                  # channel 0: range 2 * limit in every page
    x[:, :, 1] = limit                      # a constant channel at the limit
    x[:, 3, :] = -limit                     # a token at the limit everywhere
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_large_finite_kv_stays_finite(scheme, dtype):
    # Per-channel ranges up to 131,008 with every entry representable in float16: KIVI's float16 decode
    # path overflowed (code * scale > 65504) to NaN while its dequantization was finite.
    s, dt = hz.get_scheme(scheme), hz.as_dtype(dtype)
    gen = torch.Generator().manual_seed(5)
    # D = 8 for int2: 2 code bytes per token row are no whole 32-bit word, so kivi.j2 decodes them bytewise
    for D in hz.supported(s, "head_dim", (64, 8) if s.bits == 2 else (64,)):
        ks = [_large(gen, n, D, 30000.0, 65504.0) for n in (LENGTH, P)]
        vs = [_large(gen, n, D, 30000.0, 65504.0) for n in (LENGTH, P)]
        # q ~ 1e-4 keeps logits O(1): with |k| ~ 3e4, an O(1) q would make softmax one-hot on noise.
        for op, out, ref, _ in run_both(s, D, dt, ks, vs, q_scale=1e-4):
            assert torch.isfinite(ref).all(), f"{op} D={D}: the reference itself is not finite"
            assert torch.isfinite(out).all(), f"{op} D={D}: finite K/V (|x| <= 65504) gave a non-finite output"
            # outputs average values of +-65504, so rounding cancels less: fp16 pages show 2.03e-3 here
            err = hz.rel_l2(out, ref)
            assert err <= 2 * hz.tolerance(s, dt), f"{op} D={D}: rel L2 {err:.2e}"


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_beyond_float16_saturates_finite(scheme):
    # float32 compute, |K/V| up to 1e6: int8/fp8/fp32 hold them; KIVI and nuq4 (float16 scales) saturate at
    # +-65440, finite, reference and kernel alike. fp16 pages cannot hold them at all (a cast gives Inf).
    s = hz.get_scheme(scheme)
    if any(t.dtype == "float16" and t.name in ("k", "v") for t in s.page_tensors(64, P)):
        pytest.skip(f"{scheme} stores K/V as float16 itself")
    gen = torch.Generator().manual_seed(9)
    ks = [_large(gen, n, 64, 3e5, 1e6) for n in (LENGTH, P)]
    vs = [_large(gen, n, 64, 3e5, 1e6) for n in (LENGTH, P)]
    for op, out, ref, _ in run_both(s, 64, torch.float32, ks, vs, q_scale=1e-6):
        assert torch.isfinite(ref).all(), f"{op}: the reference itself is not finite"
        assert torch.isfinite(out).all(), f"{op}: finite float32 K/V gave a non-finite output"
        err = hz.rel_l2(out, ref)
        assert err <= hz.tolerance(s, torch.float32), f"{op}: rel L2 {err:.2e}"


@pytest.mark.parametrize("scheme", [p for p in hz.scheme_matrix() if p.values[0] not in ("fp32", "fp16", "bf16")])
def test_reference_marks_non_finite_groups(scheme):
    """quantize_page: a NaN/Inf makes its token (or KIVI key channel) dequantize to NaN; finite ones unchanged."""
    s = hz.get_scheme(scheme)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(H, P, 64, generator=gen)
    v = torch.randn(H, P, 64, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[0, 4, 9] = float("inf")
    v2[1, 6, 33] = float("nan")
    dk, dv = s.dequantize_page(s.quantize_page(k2, v2), 64)
    assert torch.isnan(dk[0, 4]).any() and torch.isnan(dv[1, 6]).any()
    assert torch.isfinite(dk[1]).all() and torch.isfinite(dv[0]).all()
    assert torch.isfinite(dv[1, :6]).all() and torch.isfinite(dv[1, 7:]).all()
