"""Quality and layout of the KIVI schemes (int4, int2): torch reference only, no kernels.

The attention-quality bounds compare a decode step over the cache *as the
runtime holds it* (compressed pages dequantized by the reference, the
residual tail in the compute dtype) with float32 attention over the
unquantized K/V.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.errors import SchemeCapabilityError
from kvgen.registry import default_registry
from kvgen.schemes import symbols
from kvgen_plugins.kivi import key_meta_positions, pack, unpack, value_group

H_Q, H_KV, D, TOKENS = 64, 8, 128, 4096


def scheme(name: str):
    return default_registry().schemes[name]


def pages_of(x: torch.Tensor, page: int) -> torch.Tensor:
    """[H, n, D] (n a multiple of page) -> [H * n/page, page, D]: every page as its own 'head'."""
    h, n, d = x.shape
    return x.reshape(h, n // page, page, d).reshape(h * (n // page), page, d)


def runtime_view(s, k: torch.Tensor, v: torch.Tensor, page: int, compute_dtype=torch.float16):
    """K/V ``[H, n, D]`` as the decode kernel sees them for a sequence of n tokens.

    The first ``compressed_pages(n)`` pages go through quantize/dequantize; the rest
    (the partial tail page, plus the residual window's whole pages) is stored in
    the compute dtype.
    """
    h, n, d = k.shape
    c = s.compressed_pages(n, page) * page
    kq, vq = k.clone(), v.clone()
    if c:
        t = s.quantize_page(pages_of(k[:, :c], page), pages_of(v[:, :c], page))
        kd, vd = s.dequantize_page(t, d)
        kq[:, :c] = kd.reshape(h, c, d)
        vq[:, :c] = vd.reshape(h, c, d)
    kq[:, c:] = k[:, c:].to(compute_dtype).float()
    vq[:, c:] = v[:, c:].to(compute_dtype).float()
    return kq, vq


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query [Hq, D] over all n keys [H, n, D] (GQA: query head h uses KV head h // G), float32."""
    h, n, d = k.shape
    qg = q.reshape(h, q.shape[0] // h, d)
    w = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) / math.sqrt(d), -1)
    return torch.einsum("hgn,hnd->hgd", w, v).reshape(q.shape)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def attention_error(name: str, page: int, lengths=(TOKENS, TOKENS, TOKENS), seed: int = 0) -> float:
    s = scheme(name)
    gen = torch.Generator().manual_seed(seed)
    outs, refs = [], []
    for n in lengths:
        q = torch.randn(H_Q, D, generator=gen)
        k = torch.randn(H_KV, n, D, generator=gen)
        v = torch.randn(H_KV, n, D, generator=gen)
        kq, vq = runtime_view(s, k, v, page)
        outs.append(decode_attention(q, kq, vq))
        refs.append(decode_attention(q, k, v))
    return rel_l2(torch.stack(outs), torch.stack(refs))


# ----------------------------------------------------------------------------- attention quality

@pytest.mark.parametrize("name,page,bound", [
    ("int4", 16, 0.11), ("int2", 16, 0.60),
    ("int4", 32, 0.12), ("int2", 32, 0.65),
])
def test_decode_attention_error(name, page, bound):
    err = attention_error(name, page)
    assert err <= bound, f"{name} page {page}: relative L2 error {err:.4f} > {bound}"


def test_residual_window_is_modelled():
    # 4096 tokens, page 16: int4's tail page is full, so everything is quantized;
    # int2 keeps its last 128 tokens (8 pages) in the compute dtype.
    assert scheme("int4").compressed_pages(TOKENS, 16) == 256
    assert scheme("int2").compressed_pages(TOKENS, 16) == 248
    # A partial tail page stays in the compute dtype for both.
    assert scheme("int4").compressed_pages(TOKENS + 5, 16) == 256
    assert scheme("int2").compressed_pages(TOKENS + 5, 16) == 248
    assert scheme("int2").compressed_pages(100, 16) == 0
    s = scheme("int2")
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 300, 64, generator=gen)
    v = torch.randn(2, 300, 64, generator=gen)
    kq, vq = runtime_view(s, k, v, 16)
    c = s.compressed_pages(300, 16) * 16
    assert c == 160 and 300 - c == 128 + 12
    assert torch.equal(kq[:, c:], k[:, c:].half().float()) and torch.equal(vq[:, c:], v[:, c:].half().float())
    assert (kq[:, :c] - k[:, :c]).abs().max() > 0.05  # the rest really is 2-bit


def test_int2_residual_helps():
    # The exact residual window is a real part of int2's quality on short contexts.
    assert attention_error("int2", 16, lengths=(256, 256)) < attention_error("int2", 16, lengths=(4096,)) + 0.05


# ----------------------------------------------------------------------------- roundtrip bounds

@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_roundtrip_error_per_element(name, head_dim, dtype):
    s = scheme(name)
    gen = torch.Generator().manual_seed(head_dim)
    page = 16
    k = (torch.randn(4, page, head_dim, generator=gen) * 3 + 5).to(dtype)
    v = (torch.randn(4, page, head_dim, generator=gen) * 0.01 - 2).to(dtype)
    t = s.quantize_page(k, v)
    kd, vd = s.dequantize_page(t, head_dim)
    levels = 2 ** s.bits - 1
    g = value_group(head_dim)
    ks, kz = (x[:, None, :] for x in s.key_meta(t, head_dim))
    vs = t["v_scale"].float().repeat_interleave(g, -1)
    vz = t["v_zero"].float().repeat_interleave(g, -1)
    # eps: float16 rounding of the stored zero and scale (relative 2**-11 each), plus fp32 arithmetic.
    k_eps = 2.0 ** -10 * (kz.abs() + ks * levels) + 1e-6
    v_eps = 2.0 ** -10 * (vz.abs() + vs * levels) + 1e-6
    assert ((k.float() - kd).abs() <= ks / 2 + k_eps).all()
    assert ((v.float() - vd).abs() <= vs / 2 + v_eps).all()
    # Codes use the whole range: the group minimum maps to 0, the maximum to `levels`.
    codes = unpack(t["k"], s.bits)
    assert codes.min() == 0 and codes.max() == levels
    assert kd.dtype == vd.dtype == torch.float32 and kd.shape == k.shape and vd.shape == v.shape


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_page_tensor_shapes_and_dtypes(name):
    s = scheme(name)
    k = torch.randn(3, 32, 80)
    t = s.quantize_page(k, k)
    declared = {p.name: p for p in s.page_tensors(80, 32)}
    assert list(t) == list(declared)
    for n, p in declared.items():
        assert t[n].shape == (3, *p.shape), n
        assert t[n].dtype == getattr(torch, p.dtype), n


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_page_roundtrip_helper_is_page_wise(name):
    s = scheme(name)
    k = torch.randn(2, 64, 64)
    v = torch.randn(2, 64, 64)
    kd, vd = s.roundtrip(k, v, page_size=16)
    for i in range(0, 64, 16):
        a, b = s.dequantize_page(s.quantize_page(k[:, i:i + 16], v[:, i:i + 16]), 64)
        assert torch.equal(kd[:, i:i + 16], a) and torch.equal(vd[:, i:i + 16], b)


# ----------------------------------------------------------------------------- zero ranges

@pytest.mark.parametrize("name", ["int4", "int2"])
def test_zero_range_pages_are_finite_and_exact(name):
    s = scheme(name)
    k = torch.full((2, 16, 64), 0.5)
    v = torch.zeros(2, 16, 64)
    k[1, :, :7] = -3.25          # head 1: some constant channels differ, still no range per channel
    v[1, 4] = 7.0                 # a constant token row
    t = s.quantize_page(k, v)
    kd, vd = s.dequantize_page(t, 64)
    assert all(torch.isfinite(x.float()).all() for x in t.values())
    assert (t["k_scale"] == 0).all() and (t["v_scale"] == 0).all()
    assert torch.equal(kd, k) and torch.equal(vd, v)
    # A range too small for float16 (scale underflows to 0) must not divide by zero either.
    k2 = 1.0 + torch.randn(2, 16, 64) * 1e-9
    t2 = s.quantize_page(k2, k2)
    kd2, vd2 = s.dequantize_page(t2, 64)
    assert torch.isfinite(kd2).all() and torch.isfinite(vd2).all()
    assert (kd2 - k2).abs().max() < 1e-3 and (vd2 - k2).abs().max() < 1e-3


# ----------------------------------------------------------------------------- layout

def test_bytes_per_token_per_kv_head():
    int4, int2 = scheme("int4"), scheme("int2")
    assert int4.bytes_per_token_per_kv_head(128, 16) == 176.0      # 64 + 32 + 64 + 16
    assert 176.0 / 512 == pytest.approx(0.34375)
    assert int4.bytes_per_token_per_kv_head(128, 32) == 160.0      # 64 + 16 + 64 + 16
    assert int2.bytes_per_token_per_kv_head(128, 16) == 112.0      # 32 + 32 + 32 + 16
    assert int2.bytes_per_token_per_kv_head(128, 32) == 96.0
    assert int4.bytes_per_token_per_kv_head(80, 16) == 120.0       # value group 16 at D=80
    # The formula (bytes_per_token_expr) and the planner's number (counted from the page tensors with
    # kvgen's dtype table) match the storage torch allocates for every supported shape.
    d_sym, p_sym = symbols()
    for s in (int4, int2):
        expr = s.bytes_per_token_expr()
        for d in s.head_dims:
            for p in s.page_sizes:
                stored = sum(t.nbytes_per_page_head(torch.float16) for t in s.page_tensors(d, p))
                assert float(expr.subs({d_sym: d, p_sym: p})) == pytest.approx(stored / p), (s.name, d, p)
                assert s.bytes_per_token_per_kv_head(d, p) == pytest.approx(stored / p), (s.name, d, p)


def test_value_group_and_capabilities():
    assert [value_group(d) for d in (8, 64, 80, 96, 128, 256)] == [8, 32, 16, 32, 32, 32]
    int4, int2 = scheme("int4"), scheme("int2")
    assert int4.residual_tokens == 0 and int2.residual_tokens == 128
    assert int4.tolerance == int2.tolerance == 2e-3
    for p in int2.page_sizes:
        assert 128 % p == 0
        int2.check(128, p)
    for d in (8, 64, 80, 96, 128, 256):
        int4.check(d, 16)
        int2.check(d, 16)
    with pytest.raises(SchemeCapabilityError):
        int2.check(128, 8)
    with pytest.raises(SchemeCapabilityError):
        int4.check(72, 16)


def test_packing_golden_int4():
    s = scheme("int4")
    c = torch.arange(8, dtype=torch.float32)
    k = torch.stack([torch.zeros(8), torch.full((8,), 15.0), c, 15 - c])[None]       # [1, 4, 8]
    row = torch.tensor([0, 15, 1, 2, 3, 4, 5, 6], dtype=torch.float32)
    v = torch.stack([row * (t + 1) + t for t in range(4)])[None]
    t = s.quantize_page(k, v)
    assert t["k"][0].tolist() == [
        [0x00, 0x00, 0x00, 0x00],
        [0xFF, 0xFF, 0xFF, 0xFF],
        [0x10, 0x32, 0x54, 0x76],       # channel 2j in the low nibble, 2j+1 in the high one
        [0xEF, 0xCD, 0xAB, 0x89],
    ]
    assert t["k_scale"][0].tolist() == [1.0] * 8 and t["k_zero"][0].tolist() == [0.0] * 8
    assert t["v"][0].tolist() == [[0xF0, 0x21, 0x43, 0x65]] * 4
    assert t["v_scale"][0].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert t["v_zero"][0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    kd, vd = s.dequantize_page(t, 8)
    assert torch.equal(kd, k) and torch.equal(vd, v)


def test_packing_golden_int2():
    s = scheme("int2")
    c = torch.arange(8, dtype=torch.float32) % 4
    k = torch.stack([torch.zeros(8), torch.full((8,), 3.0), c, 3 - c])[None]
    v = torch.tensor([0, 3, 1, 2, 2, 1, 3, 0], dtype=torch.float32).expand(4, 8)[None]
    t = s.quantize_page(k, v)
    assert t["k"][0].tolist() == [[0x00, 0x00], [0xFF, 0xFF], [0xE4, 0xE4], [0x1B, 0x1B]]
    assert t["v"][0].tolist() == [[0x9C, 0x36]] * 4
    kd, vd = s.dequantize_page(t, 8)
    assert torch.equal(kd, k) and torch.equal(vd, v)


@pytest.mark.parametrize("name, head_dim, stored", [
    ("int4", 16, [0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15]),     # bit-reversed in each group of 8
    ("int2", 16, [0, 8, 2, 10, 1, 9, 3, 11, 4, 12, 6, 14, 5, 13, 7, 15]),
    ("int2", 8, list(range(8))),                                            # no whole group of 16: as is
])
def test_key_metadata_order_golden(name, head_dim, stored):
    """The page stores channel d's key zero and scale at key_meta_positions(d): the order the CUDA decode reads."""
    s = scheme(name)
    d = torch.arange(head_dim, dtype=torch.float32)
    k = torch.stack([d, d + (2 ** s.bits - 1) * (d + 1)])[None]           # channel d: zero d, scale d + 1
    t = s.quantize_page(k, k)
    assert t["k_zero"][0].tolist() == [float(c) for c in stored]
    assert t["k_scale"][0].tolist() == [float(c + 1) for c in stored]
    assert [stored.index(c) for c in range(head_dim)] == key_meta_positions(head_dim, s.bits)
    kd, _ = s.dequantize_page(t, head_dim)
    assert torch.equal(kd, k)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_inverse(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 96), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 96 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes.to(torch.uint8))


def test_rounding_is_half_up():
    # Codes are floor(y + 0.5): a value exactly halfway rounds up (the kernels do the same).
    s = scheme("int4")
    k = torch.tensor([0.0, 15.0, 2.5, 3.5] + [0.0] * 12).reshape(1, 16, 1).expand(1, 16, 8).contiguous()
    t = s.quantize_page(k, torch.zeros(1, 16, 8))
    assert unpack(t["k"], 4)[0, :4, 0].tolist() == [0, 15, 3, 4]
