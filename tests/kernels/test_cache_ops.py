"""cache_write, page_quantize, dequant and page_copy kernels vs the scheme references.

Every pool starts poisoned (NaN / garbage bytes) and inputs are fresh random
data, so a kernel that writes the wrong slot, skips one, or touches a page it
should not, fails.
"""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime.pools import allocate_pool

from . import harness as hz

AXES = {"head_dim": (8, 64, 96), "page_size": (16, 32)}


def _pool(case: hz.Case, num_pages: int, dev: str) -> dict[str, torch.Tensor]:
    s = case.scheme_obj
    pool = allocate_pool(hz.pool_descriptions(s, case.head_dim, case.page_size), num_pages, case.num_kv_heads,
                         case.dtype, dev, poison=True)
    if s.residual_tokens is not None:
        pool.update(allocate_pool(hz.residual_descriptions(case.head_dim, case.page_size), num_pages,
                                  case.num_kv_heads, case.dtype, dev, poison=True))
    return pool


def _page(pool: dict[str, torch.Tensor], names, pid: int) -> dict[str, torch.Tensor]:
    return {n: pool[n][pid].cpu().clone() for n in names}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def assert_dequant_close(got: torch.Tensor, want: torch.Tensor, raw: torch.Tensor, what: str) -> None:
    """Kernel-stored vs reference-stored values, both dequantized: equal up to one quantization step.

    The step of each token is bounded by the reference's own error on it
    (``2.5 * max |want - raw|``): the kernel may round a code the other way when
    its float32 scale differs from torch's by an ulp, nothing more. At least 99%
    of the elements must match exactly.
    """
    assert not torch.isnan(got).any(), f"{what}: NaN where a token was written"
    step = (want - raw).abs().amax(-1, keepdim=True) * 2.5 + 1e-6 * raw.abs().amax(-1, keepdim=True)
    diff = (got - want).abs()
    assert (diff <= step).all(), f"{what}: max |diff| {diff.max().item():.3g} exceeds one quantization step"
    exact = (diff == 0).float().mean().item()
    assert exact >= 0.99, f"{what}: only {exact:.1%} of elements match the reference exactly"


# --------------------------------------------------------------------------- cache_write


@pytest.mark.parametrize("case", hz.kernel_specs(AXES))
def test_cache_write(case):
    dev = hz.device()
    s = case.scheme_obj
    H, D, P = case.num_kv_heads, case.head_dim, case.page_size
    residual = s.residual_tokens is not None
    num_pages = 6
    pool = _pool(case, num_pages, dev)
    names = ["rk", "rv"] if residual else [t.name for t in s.page_tensors(D, P)]
    before = {n: pool[n].cpu().clone() for n in pool}

    gen = torch.Generator().manual_seed(case.head_dim * 7 + P)
    # slots in pages 1, 3, 4 (random order, some partial pages), page 0/2/5 untouched; some skipped
    slots = torch.cat([torch.arange(P, 2 * P), torch.arange(3 * P, 3 * P + P // 2), torch.arange(4 * P + 3, 4 * P + 5)])
    slots = slots[torch.randperm(slots.numel(), generator=gen)]
    n = slots.numel() + 3
    slot_mapping = torch.cat([slots[:5], torch.tensor([-1]), slots[5:], torch.tensor([-1, -7])]).long()
    k = (torch.randn(n, H, D, generator=gen) * 2).to(case.dtype)
    v = torch.randn(n, H, D, generator=gen).to(case.dtype)

    mod = hz.load_op("cache_write", s, D, H, case.gqa, P, case.dtype, dev=dev)
    # 8 tokens per program: 29 (P=16) or 53 (P=32) rows leave a partial last program, and skipped rows
    # sit inside programs
    mod.launch(k.to(dev), v.to(dev), pool, slot_mapping.to(dev), config={"tokens_per_program": 8})
    with pytest.raises(ValueError, match="power of two"):
        mod.launch(k.to(dev), v.to(dev), pool, slot_mapping.to(dev), config={"tokens_per_program": 3})

    written = {int(x) for x in slots}
    by_page: dict[int, list[tuple[int, int]]] = {}
    for i, sl in enumerate(slot_mapping.tolist()):
        if sl >= 0:
            by_page.setdefault(sl // P, []).append((sl % P, i))
    for pid in range(num_pages):
        if pid not in by_page:
            for name in pool:
                assert _same_bits(pool[name][pid], before[name][pid]), f"page {pid} of {name} changed"
    for name in pool:
        if name not in names:
            assert _same_bits(pool[name], before[name]), f"{name} is not this scheme's write pool but changed"

    for pid, entries in by_page.items():
        slots_here = [t for t, _ in entries]
        rows = [i for _, i in entries]
        unwritten = [t for t in range(P) if t not in slots_here]
        kf, vf = k.float()[rows].transpose(0, 1), v.float()[rows].transpose(0, 1)  # [H, n, D]
        if residual:
            got_k, got_v = pool["rk"][pid].cpu(), pool["rv"][pid].cpu()
            assert torch.equal(got_k[:, slots_here], k[rows].transpose(0, 1)), "residual K not an exact copy"
            assert torch.equal(got_v[:, slots_here], v[rows].transpose(0, 1)), "residual V not an exact copy"
            assert torch.isnan(got_k[:, unwritten].float()).all() and torch.isnan(got_v[:, unwritten].float()).all()
            continue
        # reference: the same tokens quantized into a NaN page by the torch reference
        kp = torch.full((H, P, D), float("nan"))
        vp = torch.full((H, P, D), float("nan"))
        kp[:, slots_here], vp[:, slots_here] = kf, vf
        want_k, want_v = s.dequantize_page(s.quantize_page(kp, vp), D)
        got_k, got_v = s.dequantize_page(_page(pool, names, pid), D)
        old_k, old_v = s.dequantize_page(_page(before, names, pid), D)
        assert_dequant_close(got_k[:, slots_here], want_k[:, slots_here], kf, f"K page {pid}")
        assert_dequant_close(got_v[:, slots_here], want_v[:, slots_here], vf, f"V page {pid}")
        # slots nobody wrote keep their poison
        assert torch.equal(got_k[:, unwritten].isnan(), old_k[:, unwritten].isnan())
        assert torch.isnan(got_k[:, unwritten]).all() and torch.isnan(got_v[:, unwritten]).all()
    assert written


# --------------------------------------------------------------------------- page_quantize


@pytest.mark.parametrize("case", hz.kernel_specs(AXES))
def test_page_quantize(case):
    check_page_quantize(case, hz.device())


def check_page_quantize(case: hz.Case, dev: str) -> None:
    s = case.scheme_obj
    H, D, P = case.num_kv_heads, case.head_dim, case.page_size
    mod = hz.load_op("page_quantize", s, D, H, case.gqa, P, case.dtype, dev=dev)
    if s.residual_tokens is None:
        with pytest.raises(RuntimeError, match="no residual pages"):
            mod.launch({}, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        return
    num_pages = 5
    pool = _pool(case, num_pages, dev)
    gen = torch.Generator().manual_seed(D + P)
    raw_k = torch.randn(num_pages, H, P, D, generator=gen) * 1.5
    raw_v = torch.randn(num_pages, H, P, D, generator=gen)
    pool["rk"].copy_(raw_k.to(case.dtype))
    pool["rv"].copy_(raw_v.to(case.dtype))
    names = [t.name for t in s.page_tensors(D, P)]
    before = {n: pool[n].cpu().clone() for n in names}
    src = torch.tensor([3, 0, 4], dtype=torch.int32)
    dst = torch.tensor([1, 4, 2], dtype=torch.int32)
    mod.launch(pool, src.to(dev), dst.to(dev))
    for sp, dp in zip(src.tolist(), dst.tolist()):
        kf, vf = pool["rk"][sp].cpu().float(), pool["rv"][sp].cpu().float()
        want_k, want_v = s.dequantize_page(s.quantize_page(kf, vf), D)
        got_k, got_v = s.dequantize_page(_page(pool, names, dp), D)
        assert_dequant_close(got_k, want_k, kf, f"K page {sp}->{dp}")
        assert_dequant_close(got_v, want_v, vf, f"V page {sp}->{dp}")
    for pid in set(range(num_pages)) - set(dst.tolist()):
        for n in names:
            assert _same_bits(pool[n][pid], before[n][pid]), f"compressed page {pid} of {n} changed"


# --------------------------------------------------------------------------- dequant


@pytest.mark.parametrize("case", hz.kernel_specs(AXES))
def test_dequant(case):
    check_dequant(case, hz.device())


def check_dequant(case: hz.Case, dev: str) -> None:
    s = case.scheme_obj
    H, D, P = case.num_kv_heads, case.head_dim, case.page_size
    w = hz.residual_window(s)
    cache = hz.make_cache(s, D, H, P, [w + 3 * P + 1, w + P + 2], case.dtype, device=dev, seed=D + P)
    pages = [pid for b, ids in enumerate(cache.pages) for pid in ids[: cache.compressed_counts[b]]]
    assert pages, "the cache must have compressed pages"
    pages_t = torch.tensor(pages[::-1], dtype=torch.int32)
    k_out = hz.poisoned_like(torch.empty(len(pages), H, P, D, dtype=case.dtype, device=dev))
    v_out = hz.poisoned_like(k_out)
    mod = hz.load_op("dequant", s, D, H, case.gqa, P, case.dtype, dev=dev)
    mod.launch(cache.pools, pages_t.to(dev), k_out, v_out)
    names = cache.tensor_names()
    # On the GPU, code * scale + zero is one fused multiply-add (torch rounds twice), so a value
    # sitting on a rounding boundary of the output dtype may land one ulp away: allow one ulp there,
    # but nearly every element must still be bit-equal.
    one_ulp = torch.finfo(case.dtype).eps if dev != "cpu" else 1e-5
    inexact = 0
    for i, pid in enumerate(pages_t.tolist()):
        want_k, want_v = s.dequantize_page(_page(cache.pools, names, pid), D)
        for got, want in ((k_out[i].cpu(), want_k.to(case.dtype)), (v_out[i].cpu(), want_v.to(case.dtype))):
            # unwritten slots of a partial last page dequantize to NaN in both (poison)
            torch.testing.assert_close(got, want, equal_nan=True, rtol=one_ulp, atol=1e-6)
            inexact += int(((got != want) & ~(got.isnan() & want.isnan())).sum())
    assert inexact <= 1e-3 * 2 * k_out.numel(), f"{inexact} dequantized elements differ from the reference"
    # the tokens a sequence holds are exactly what the decode reference sees
    b0 = cache.pages[0][: cache.compressed_counts[0]]
    first = pages_t.tolist().index(b0[0])
    torch.testing.assert_close(k_out[first, :, :P].cpu().float(), cache.ks[0][:, :P].to(case.dtype).float())


# --------------------------------------------------------------------------- page_copy


@pytest.mark.parametrize("case", hz.kernel_specs({"head_dim": (8, 96), "page_size": (16,)}))
def test_page_copy(case):
    check_page_copy(case, hz.device())


def check_page_copy(case: hz.Case, dev: str) -> None:
    s = case.scheme_obj
    H, D, P = case.num_kv_heads, case.head_dim, case.page_size
    w = hz.residual_window(s)
    cache = hz.make_cache(s, D, H, P, [w + 2 * P + 3, w + P + 1], case.dtype, device=dev, seed=3, spare=6)
    tensors = list(cache.pools.values())
    before = [t.cpu().clone() for t in tensors]
    num_pages = min(t.shape[0] for t in tensors)
    assert num_pages >= 6
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(D)).to(torch.int32)
    src, dst = perm[:3], perm[3:6]
    mod = hz.load_op("page_copy", s, D, H, case.gqa, P, case.dtype, dev=dev)
    mod.launch(tensors, src.to(dev), dst.to(dev))
    for t, old in zip(tensors, before):
        for sp, dp in zip(src.tolist(), dst.tolist()):
            assert _same_bits(t[dp], old[sp]), "copied page differs from its source"
        for p in range(t.shape[0]):
            if p not in dst.tolist():
                assert _same_bits(t[p], old[p]), f"page {p} changed though it was no destination"


def test_page_copy_odd_sizes():
    """Pages whose byte size is not a multiple of 4 (uint8 path) and float8 pages copy bit-exactly."""
    dev = hz.device()
    mod = hz.load_op("page_copy", "fp32", 64, 2, 1, 16, torch.float32, dev=dev)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (6, 3, 5), generator=gen, dtype=torch.uint8)
    b = torch.randn(6, 2, 7, generator=gen).to(torch.float8_e4m3fn)
    c = torch.randn(6, 2, 3, generator=gen).to(torch.float16)
    olds = [x.clone() for x in (a, b, c)]
    ts = [x.to(dev) for x in (a, b, c)]
    mod.launch(ts, torch.tensor([5, 0], dtype=torch.int32).to(dev), torch.tensor([1, 3], dtype=torch.int32).to(dev))
    for t, old in zip(ts, olds):
        want = old.clone()
        want[1], want[3] = old[5], old[0]
        assert _same_bits(t, want)


# --------------------------------------------------------------------------- pools


def test_allocate_pool_shapes_and_poison():
    descr = [{"name": "k", "dtype": "int8", "shape": (16, 64)}, {"name": "k_scale", "dtype": "float32", "shape": (16,)},
             {"name": "rk", "dtype": "compute", "shape": (16, 64)}, {"name": "f8", "dtype": "float8_e4m3fn", "shape": (4,)}]
    pool = allocate_pool(descr, 3, 2, torch.float16, "cpu", poison=True)
    assert pool["k"].shape == (3, 2, 16, 64) and pool["k"].dtype == torch.int8 and pool["k"].is_contiguous()
    assert pool["rk"].dtype == torch.float16 and torch.isnan(pool["rk"]).all()
    assert torch.isnan(pool["k_scale"]).all() and torch.isnan(pool["f8"].float()).all()
    assert (pool["k"].view(torch.uint8) == 0xA5).all()
    zero = allocate_pool(descr, 2, 1, torch.float32, "cpu", zero=True)
    assert all((t.view(torch.uint8) == 0).all() for t in zero.values())
    with pytest.raises(ValueError):
        allocate_pool([{"name": "x", "dtype": "nope", "shape": (1,)}], 1, 1, torch.float32)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
def test_cache_ops_gpu(scheme):
    """cache_write of a 4096-token chunk (8 KV heads, D=128, bfloat16) then dequant, vs the references."""
    hz.require_cuda()
    s = hz.get_scheme(scheme)
    D = hz.supported(s, "head_dim", (128,))[0]
    P = hz.supported(s, "page_size", (16,))[0]
    case = hz.Case(scheme=scheme, head_dim=D, gqa=8, page_size=P, compute_dtype="bfloat16", num_kv_heads=8)
    n = 4096
    pool = _pool(case, n // P + 4, "cuda")
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(n // P + 4, generator=gen)[: n // P]
    slots = (perm[:, None] * P + torch.arange(P)[None, :]).flatten().long()
    k = torch.randn(n, 8, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(n, 8, D, generator=gen).to(torch.bfloat16)
    mod = hz.load_op("cache_write", s, D, 8, 8, P, torch.bfloat16, dev="cuda")
    mod.launch(k.cuda(), v.cuda(), pool, slots.cuda())
    torch.cuda.synchronize()
    if s.residual_tokens is not None:
        got = pool["rk"][perm.cuda()].cpu()  # [pages, H, P, D]
        assert torch.equal(got, k.view(n // P, P, 8, D).transpose(1, 2))
        return
    names = [t.name for t in s.page_tensors(D, P)]
    for j, pid in enumerate(perm[:32].tolist()):
        kf = k[j * P:(j + 1) * P].float().transpose(0, 1)
        vf = v[j * P:(j + 1) * P].float().transpose(0, 1)
        want_k, want_v = s.dequantize_page(s.quantize_page(kf, vf), D)
        got_k, got_v = s.dequantize_page(_page(pool, names, pid), D)
        assert_dequant_close(got_k, want_k, kf, f"K page {pid}")
        assert_dequant_close(got_v, want_v, vf, f"V page {pid}")


@pytest.mark.skipif("fp8" not in hz.default_registry().schemes, reason="fp8 scheme not registered")
@pytest.mark.parametrize("native", [1, 0], ids=["native-where-available", "integer-encode"])
def test_fp8_encode_bit_exact(native):
    """The fp8 store macro's RNE encode equals torch's float8_e4m3fn cast, subnormals and ties included.

    On a GPU with float8 conversions (sm_89+) ``native`` 1 runs the hardware conversion and 0 the integer
    encode; elsewhere (the interpreter) both run the integer encode.
    """
    dev = hz.device()
    D, P, H = 64, 16, 1
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([448.0, -448.0, 0.0, -0.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10,
                         1.0625, 1.1875, -1.0625, 240.0, 232.0, 2.0 ** -7 * 1.0625, 2.0 ** -12, 447.0, 1e-30])
    mags = 2.0 ** (torch.rand(P * D, generator=gen) * 30 - 21)
    vals = mags * torch.where(torch.rand(P * D, generator=gen) < 0.5, -1.0, 1.0)
    vals[: grid.numel()] = grid
    k = vals.view(P, 1, D).clone()
    k[:, 0, 0] = 448.0  # amax 448 -> scale exactly 1, so the stored codes are e4m3(x)
    k[:, 0, 1:] = k[:, 0, 1:].clamp(-448, 448)
    v = k.flip(-1).clone()
    case = hz.Case(scheme="fp8", head_dim=D, gqa=1, page_size=P, compute_dtype="float32", num_kv_heads=H)
    pool = _pool(case, 1, dev)
    mod = hz.load_op("cache_write", "fp8", D, H, 1, P, torch.float32, dev=dev)
    mod.launch(k.to(dev), v.to(dev), pool, torch.arange(P, dtype=torch.int64).to(dev), config={"native_fp8": native})
    want = k[:, 0].to(torch.float8_e4m3fn).view(torch.uint8)
    got = pool["k"][0, 0].cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"codes differ at {bad[:5].tolist()}: x={k[:, 0][tuple(bad[0])].item()!r}"
    assert torch.equal(pool["k_scale"][0, 0].cpu(), torch.ones(P))
    assert torch.equal(pool["v"][0, 0].cpu(), v[:, 0].to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
def test_page_ops_gpu(scheme):
    """page_quantize, dequant and page_copy at D=128, 8 KV heads, bfloat16, on the GPU."""
    hz.require_cuda()
    s = hz.get_scheme(scheme)
    case = hz.Case(scheme=scheme, head_dim=hz.supported(s, "head_dim", (128,))[0], gqa=8,
                   page_size=hz.supported(s, "page_size", (16,))[0], compute_dtype="bfloat16", num_kv_heads=8)
    check_page_quantize(case, "cuda")
    check_dequant(case, "cuda")
    check_page_copy(case, "cuda")
