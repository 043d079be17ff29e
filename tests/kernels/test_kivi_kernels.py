"""KIVI-specific kernel checks the shared matrix does not make.

- page_quantize (the scheme's ``store_page`` macro) writes the same bytes,
  scales and zeros as the torch reference ``quantize_page``, bit for bit,
  including head dims whose value group is not 32 (D = 80 -> 16, D = 8 -> 8)
  and pages with no range (scale 0, never a division by zero);
- dequant (``load_page``) matches ``dequantize_page``;
- decode at D = 80, which the shared matrix's head dims skip;
- page_quantize at float16's limit and on NaN/Inf input (tests/kernels/test_numerics.py
  has the attention-level contract).
"""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime.pools import allocate_pool

from . import harness as hz
from .test_decode_matrix import run_decode

KIVI = ("int4", "int2")
# (head_dim, page, compute dtype): the odd value groups and both interpreter dtypes.
SHAPES = [(8, 16, "float32"), (80, 16, "float16"), (128, 32, "float32"), (256, 16, "float16")]


def _residual_pages(num_pages: int, H: int, P: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, H, P, D, generator=gen) * 2 + 0.5
    v = torch.randn(num_pages, H, P, D, generator=gen)
    k[0, 0, :, : D // 2] = 0.75       # constant channels: no key range
    v[0, 1 % H, 3] = -1.5             # a constant token row: no value range
    k[1] = 0.0                        # an all-zero page
    v[1] = 0.0
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("name", KIVI)
@pytest.mark.parametrize("head_dim,page,dtype", SHAPES)
def test_page_quantize_matches_reference_bit_for_bit(name, head_dim, page, dtype):
    s = hz.get_scheme(name)
    if page not in s.page_sizes:
        pytest.skip(f"{name} does not declare page {page}")
    H, M, dt = 2, 3, hz.as_dtype(dtype)
    dev = hz.device()
    k, v = _residual_pages(M, H, page, head_dim, dt, seed=head_dim)
    pools = allocate_pool(hz.pool_descriptions(s, head_dim, page), M + 2, H, dt, "cpu", poison=True)
    pools.update(allocate_pool(hz.residual_descriptions(head_dim, page), M + 1, H, dt, "cpu", poison=True))
    src = torch.tensor([2, 0, 3], dtype=torch.int32)      # residual pool ids
    dst = torch.tensor([4, 1, 0], dtype=torch.int32)      # compressed pool ids, shuffled
    for i, r in enumerate(src.tolist()):
        pools["rk"][r] = k[i]
        pools["rv"][r] = v[i]
    before = {n: t.clone() for n, t in pools.items()}
    pools = {n: t.to(dev) for n, t in pools.items()}
    mod = hz.load_op("page_quantize", s, head_dim, H, 4, page, dt, dev=dev)
    # a skipped pair (src -1: a CUDA graph's padding) in the middle, aimed at page 2, which must keep its poison
    pad_src, pad_dst = torch.tensor([2, -1, 0, 3], dtype=torch.int32), torch.tensor([4, 2, 1, 0], dtype=torch.int32)
    mod.launch(pools, pad_src.to(dev), pad_dst.to(dev))
    for i, d in enumerate(dst.tolist()):
        ref = s.quantize_page(k[i], v[i])
        for n, t in ref.items():
            got = pools[n][d].cpu()
            assert torch.isfinite(got.float()).all(), f"page {i} {n}: non-finite values"
            assert torch.equal(got, t), f"page {i} {n}: {int((got.float() != t.float()).sum())} elements differ"
    # pages outside dst keep their poison, byte for byte (no stray writes past D or the page)
    for n in ref:
        for untouched in (2, 3):
            assert torch.equal(pools[n][untouched].cpu().view(torch.uint8), before[n][untouched].view(torch.uint8)), n


def _extreme_pages(H: int, P: int, D: int, dtype: torch.dtype, seed: int):
    """Pages at float16's limit (issue 13, item 7): channel ranges past 65504, +-65504 entries, NaN and Inf."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(3, H, P, D, generator=gen) * 30000).clamp(-65504, 65504)
    v = (torch.randn(3, H, P, D, generator=gen) * 30000).clamp(-65504, 65504)
    k[0, :, ::2, 0], k[0, :, 1::2, 0] = 65504.0, -65504.0      # range 131008 in channel 0
    k[0, :, :, 1] = 65504.0                                    # a constant channel at the limit
    v[0, :, 2, :] = -65504.0
    k[1, 0, 3, 5] = float("nan")                               # page 1: NaN key (head 0), Inf value (head 1)
    v[1, 1 % H, 4, 6] = float("inf")
    k[2, 1 % H, 7, 2] = float("-inf")                          # page 2: -Inf key, NaN value
    v[2, 0, 1, 0] = float("nan")
    return k.to(dtype), v.to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal elementwise, NaN equal to NaN (NaN payloads may differ between torch and the kernels)."""
    g, w = got.float(), want.float()
    return torch.equal(g.isnan(), w.isnan()) and torch.equal(torch.nan_to_num(g), torch.nan_to_num(w))


# numpy (the interpreter) warns about the inf/nan arithmetic these inputs exist to provoke
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("name", KIVI)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_page_quantize_extremes_match_reference(name, dtype):
    # The kernel's store_page and the reference clamp, cap and mark non-finite groups alike: codes bit for bit,
    # scales/zeros equal (NaN where a group held a NaN or an Inf), every dequantized value finite elsewhere and
    # within float16's range.
    s, H, P, D, dt, dev = hz.get_scheme(name), 2, 16, 64, hz.as_dtype(dtype), hz.device()
    k, v = _extreme_pages(H, P, D, dt, seed=11)
    pools = allocate_pool(hz.pool_descriptions(s, D, P), 3, H, dt, "cpu", poison=True)
    pools.update(allocate_pool(hz.residual_descriptions(D, P), 3, H, dt, "cpu", poison=True))
    pools["rk"][:], pools["rv"][:] = k, v
    pools = {n: t.to(dev) for n, t in pools.items()}
    pages = torch.arange(3, dtype=torch.int32, device=dev)
    hz.load_op("page_quantize", s, D, H, 4, P, dt, dev=dev).launch(pools, pages, pages)
    for i in range(3):
        ref = s.quantize_page(k[i].float(), v[i].float())
        for n, t in ref.items():
            assert _same(pools[n][i].cpu(), t), f"page {i} {n}: kernel and reference differ"
        dk, dv = s.dequantize_page(ref, D)
        for x, raw, what in ((dk, k[i], "K"), (dv, v[i], "V")):
            ok = ~x.isnan()
            assert torch.isfinite(x[ok]).all() and x[ok].abs().max() <= 65504, f"page {i} {what} out of float16 range"
            assert torch.isfinite(raw).all() == ok.all(), f"page {i} {what}: NaN marks do not match the input"


@pytest.mark.parametrize("name", KIVI)
@pytest.mark.parametrize("head_dim,page,dtype", SHAPES)
def test_dequant_matches_reference(name, head_dim, page, dtype):
    s = hz.get_scheme(name)
    if page not in s.page_sizes:
        pytest.skip(f"{name} does not declare page {page}")
    H, dt, dev = 2, hz.as_dtype(dtype), hz.device()
    k, v = _residual_pages(3, H, page, head_dim, torch.float32, seed=7)
    pools = allocate_pool(hz.pool_descriptions(s, head_dim, page), 4, H, dt, "cpu", poison=True)
    for i in range(3):
        for n, t in s.quantize_page(k[i], v[i]).items():
            pools[n][i + 1] = t
    pools = {n: t.to(dev) for n, t in pools.items()}
    pages = torch.tensor([3, 1, 2], dtype=torch.int32, device=dev)
    k_out = hz.poisoned_like(torch.empty(3, H, page, head_dim, dtype=dt, device=dev))
    v_out = hz.poisoned_like(k_out)
    hz.load_op("dequant", s, head_dim, H, 4, page, dt, dev=dev).launch(pools, pages, k_out, v_out)
    for j, p in enumerate(pages.tolist()):
        kr, vr = s.dequantize_page({n: pools[n][p].cpu() for n in pools}, head_dim)
        torch.testing.assert_close(k_out[j].cpu().float(), kr.to(dt).float(), rtol=0, atol=0)
        torch.testing.assert_close(v_out[j].cpu().float(), vr.to(dt).float(), rtol=0, atol=0)


@pytest.mark.parametrize("name", KIVI)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_head_dim_80(name, dtype):
    # D = 80: BLOCK_D = 128 of padded lanes, value group 16, D/F bytes not a power of two.
    s = hz.get_scheme(name)
    case = hz.Case(scheme=name, head_dim=80, gqa=4, page_size=16, compute_dtype=dtype)
    w = hz.residual_window(s)
    lengths = [w + 5 * 16 + 3, 1, w + 16, w + 2 * 16 - 1]
    out, ref, *_ = run_decode(case, lengths, config={"num_splits": 2, "pages_per_tile": 2}, seed=21)
    hz.check(case, out, ref, f"D=80 lengths {lengths}")
