"""nuq4's torch reference: layout, round trip, outliers, bytes per token."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen_nuq.codebook import encode, midpoints, outliers_per_token
from kvgen_nuq.scheme import Nuq4, pack4, unpack4, value_group

UNIFORM = torch.linspace(-1.0, 1.0, 16)


@pytest.fixture(scope="module")
def scheme() -> Nuq4:
    return Nuq4()


def page(h=2, p=16, d=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, p, d, generator=g) * scale, torch.randn(h, p, d, generator=g) * scale


def test_pack_unpack_roundtrip():
    codes = torch.randint(0, 16, (3, 5, 64))
    packed = pack4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(unpack4(packed), codes)
    # channel 2j in the low nibble, 2j+1 in the high nibble of byte j
    assert pack4(torch.tensor([[3, 12]]))[0, 0].item() == 3 | (12 << 4)


@pytest.mark.parametrize("d", [8, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("p", [8, 16, 64])
def test_quantize_page_matches_declared_layout(scheme, d, p):
    k, v = page(p=p, d=d)
    out = scheme.quantize_page(k, v)
    declared = scheme.page_tensors(d, p)
    assert list(out) == [t.name for t in declared]
    for t in declared:
        assert out[t.name].shape == (2, *t.shape), t.name
        assert out[t.name].dtype == getattr(torch, t.dtype), t.name


@pytest.mark.parametrize("d,p", [(64, 16), (128, 16), (128, 64), (8, 16), (96, 32)])
def test_roundtrip_error_bounds(scheme, d, p):
    k, v = page(p=p, d=d, seed=d + p)
    q = scheme.quantize_page(k, v)
    kd, vd = scheme.dequantize_page(q, d)
    cb = scheme.codebook(p)
    # Keys: an inlier is at most half the widest level gap (or the distance past the end
    # levels) times the channel's half range away, plus float16 rounding of scale and zero.
    gap = max(float((cb[1:] - cb[:-1]).max()) / 2, 1 - float(cb[-1]), float(cb[0]) + 1)
    s = q["k_scale"].float().unsqueeze(-2)
    z = q["k_zero"].float().unsqueeze(-2)
    bound = gap * s + 2e-3 * (s + z.abs()) + 1e-6
    outl = torch.zeros_like(k, dtype=torch.bool).scatter(-1, q["k_oidx"].long(), True)
    assert ((kd - k).abs() <= bound)[~outl].all()
    # Outliers come back exactly as float16.
    assert torch.equal(kd[outl], k[outl].half().float())
    # Values: uniform 4-bit per group, error <= scale / 2 plus float16 rounding of zero.
    g = value_group(d)
    vs = q["v_scale"].float().repeat_interleave(g, -1)
    vz = q["v_zero"].float().repeat_interleave(g, -1)
    assert ((vd - v).abs() <= vs / 2 + 1e-3 * vz.abs() + 1e-6).all()
    # The error is what 4 bits give: a few percent, not more.
    assert (kd - k).norm() / k.norm() < 0.1
    assert (vd - v).norm() / v.norm() < 0.12


def test_roundtrip_many_pages(scheme):
    k, v = page(h=2, p=64, d=64)
    kd, vd = scheme.roundtrip(k, v, page_size=16)
    for i in range(0, 64, 16):
        a, b = scheme.dequantize_page(scheme.quantize_page(k[:, i:i + 16], v[:, i:i + 16]), 64)
        assert torch.equal(kd[:, i:i + 16], a) and torch.equal(vd[:, i:i + 16], b)
    with pytest.raises(ValueError):
        scheme.roundtrip(k[:, :20], v[:, :20], page_size=16)


def test_codes_are_nearest_level(scheme):
    cb = scheme.codebook(16)
    x = torch.linspace(-1.3, 1.3, 10001)
    codes = encode(x, cb)
    nearest = (x[:, None] - cb[None, :]).abs().argmin(-1)
    # Equal except exactly on a midpoint, where either level is as near.
    differ = codes != nearest
    assert torch.isin(x[differ], midpoints(cb)).all()


def test_outliers_spike_token(scheme):
    k, v = page(d=64)
    k[0, 5, 17] = 50.0      # a single-token spike
    k[1, 3, 2] = -70.0
    q = scheme.quantize_page(k, v)
    assert q["k_oidx"][0, 5, 0].item() == 17 and q["k_oval"][0, 5, 0].item() == 50.0
    assert q["k_oidx"][1, 3, 0].item() == 2 and q["k_oval"][1, 3, 0].item() == -70.0
    # The spike does not stretch its channel's range: the other tokens keep fine steps.
    assert q["k_scale"][0, 17].item() < 5.0 and q["k_scale"][1, 2].item() < 5.0
    kd, _ = scheme.dequantize_page(q, 64)
    assert kd[0, 5, 17].item() == 50.0 and kd[1, 3, 2].item() == -70.0


def test_outliers_massive_channel(scheme):
    k, v = page(d=64)
    k[:, :, 9] += 30.0       # every token's largest entry: the whole channel is kept exactly
    q = scheme.quantize_page(k, v)
    assert (q["k_oidx"][..., 0] == 9).all()
    assert (q["k_scale"][:, 9] == 0).all() and (q["k_zero"][:, 9] == 0).all()
    kd, _ = scheme.dequantize_page(q, 64)
    assert torch.equal(kd[:, :, 9], k[:, :, 9].half().float())
    # It takes every token's outlier slot, so the other channels keep their full range.
    half_range = ((k.amax(1) - k.amin(1)) * 0.5).half()
    assert torch.equal(q["k_scale"][:, :9], half_range[:, :9]) and torch.equal(q["k_scale"][:, 10:], half_range[:, 10:])


def test_outlier_count_and_ties(scheme):
    assert [outliers_per_token(d) for d in (8, 64, 128, 199, 200, 256)] == [1, 1, 1, 1, 2, 2]
    k = torch.zeros(1, 8, 256)
    k[0, :, 40] = 3.0
    k[0, :, 7] = -3.0        # same magnitude: the lower channel first
    k[0, 0, 100] = 2.0
    q = Nuq4().quantize_page(k, k.clone())
    assert q["k_oidx"].shape == (1, 8, 2)
    assert q["k_oidx"][0, :, 0].tolist() == [7] * 8
    assert q["k_oidx"][0, :, 1].tolist() == [40] * 8


def test_constant_and_zero_pages(scheme):
    k = torch.full((2, 16, 64), 0.25)
    v = torch.zeros(2, 16, 64)
    kd, vd = scheme.dequantize_page(scheme.quantize_page(k, v), 64)
    assert torch.equal(kd, k) and torch.equal(vd, v)


def test_bytes_per_token_vs_int4(scheme):
    # D = 128, page 16: K codes 64 + K scale/zero 2*2*128/16 = 32 + one outlier (1 + 2) = 3
    # + V codes 64 + V scale/zero 2*2*128/32 = 16.
    assert scheme.bytes_per_token_per_kv_head(128, 16) == 179
    int4 = 64 + 2 * 2 * 128 / 16 + 64 + 2 * 2 * 128 / 32     # KIVI int4, same K/V groups, no outliers
    assert scheme.bytes_per_token_per_kv_head(128, 16) - int4 == 3
    from kvgen.schemes import symbols

    expr, (sym_d, sym_p) = scheme.bytes_per_token_expr(), symbols()
    for d in (8, 64, 80, 96, 128, 256):
        for p in (8, 16, 32, 64, 128):
            declared = sum(t.nbytes_per_page_head(torch.float16) for t in scheme.page_tensors(d, p)) / p
            assert math.isclose(scheme.bytes_per_token_per_kv_head(d, p), declared), (d, p)
            # the formula (sympy) says the same as the page tensors the planner counts (no sympy)
            assert expr.subs({sym_d: d, sym_p: p}) == scheme.page_bytes_per_token(d, p), (d, p)


def test_capabilities(scheme):
    assert scheme.residual_tokens == 0 and scheme.compressed_pages(33, 16) == 2
    scheme.check(128, 16)
    with pytest.raises(Exception):
        scheme.check(100, 16)
    params = scheme.params()
    assert params["bits"] == 4 and set(params["codebooks"]) == {str(p) for p in scheme.page_sizes}
    assert all(len(c) == 16 for c in params["codebooks"].values())


def test_page_sizes_follow_the_codebook_file():
    s = Nuq4({16: UNIFORM.tolist(), 64: UNIFORM.tolist()}, "test")
    assert s.page_sizes == (16, 64)
    with pytest.raises(Exception, match="no codebook for page size 32"):
        s.codebook(32)
    one = Nuq4(UNIFORM.tolist(), "one list")
    assert one.page_sizes == Nuq4.page_sizes
