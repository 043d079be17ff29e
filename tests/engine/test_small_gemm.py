"""The small GEMM for 5 to 64 rows (kvgen/engine/small_gemm.py, small_gemm_kernel.py) and its place in the chooser.

CPU (CI, Triton interpreter, float32/float16): every row bucket, split and
bias against a float64 reference on random inputs, with ragged column tails,
a strided x and poisoned outputs; the split arrival counters are left zero
for the next launch; the refusals. GPU (``-m gpu``): bfloat16 and float16 at
a Llama layer's shapes against float64, in a CUDA graph (replayed with new
inputs, and with PDL), and ``gemv.choose`` keeps it only where it timed
faster and checked.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from kvgen.engine import gemv, pdl, small_gemm
from kvgen.runtime import split_counters
from tests.kernels.harness import require_cuda


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _rel_l2(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def _dyadic(shape, g, dtype):
    """Random multiples of 1/64 in [-1, 1]: their products are multiples of 2^-12 of magnitude at most 1, so at
    K <= 1024 every partial sum fits float32's 24 bits and a dot product is exact in any summation order. The tests
    that compare two kernels bit for bit need that: the interpreter's dot is the host BLAS, whose order on some CPUs
    (OpenBLAS's AVX2 kernels) depends on an output column's place in the tile. Sums still round in float16, so the
    model-dtype roundings are tested."""
    return (torch.randint(-64, 65, shape, generator=g).to(torch.float32) / 64).to(dtype)


@pytest.fixture
def interpret():
    """The CPU tests' kernels run on Triton's interpreter (tests/conftest.py sets it for CPU runs)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel on Triton's CPU interpreter (TRITON_INTERPRET=1)")


def test_row_buckets_and_candidates():
    assert [small_gemm.row_block(r) for r in (5, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert [gemv._bucket(r) for r in (1, 2, 3, 4, 5, 8, 20, 48)] == [1, 2, 4, 4, 16, 16, 32, 64]
    cands = small_gemm.candidates(4096, 4096, 132)
    assert cands and all(4096 % c.block_k == 0 for c in cands)
    for tile in {(c.block_n, c.block_k) for c in cands}:
        splits = [c.split_k for c in cands if (c.block_n, c.block_k) == tile]
        assert splits[0] == 1 and splits == sorted(splits)
        # the last split is the first to put two programs on every SM (or the most k blocks allow)
        assert -(-4096 // tile[0]) * splits[-1] >= 2 * 132 or splits[-1] * 2 > 4096 // tile[1]
    # a k no tile's block divides: nothing to time
    assert small_gemm.candidates(4096, 4100, 132) == []
    # tiles whose stages exceed the shared memory at a row bucket are left out
    limit = 227 << 10
    fit64 = small_gemm.candidates(4096, 4096, 132, 64, limit)
    assert fit64 and len(fit64) < len(cands)
    assert all(small_gemm.shared_bytes(c, 64) <= limit for c in fit64)
    assert {(c.block_n, c.block_k) for c in cands} - {(c.block_n, c.block_k) for c in fit64}


def test_prefetch_blocks_from_the_switch(monkeypatch):
    cfg = small_gemm.Config(64, 128, 1)  # a k block of 64 rows x 128 bfloat16: 16 KiB
    monkeypatch.delenv(pdl.PREFETCH_SWITCH, raising=False)
    assert small_gemm.prefetch_blocks(cfg, 4096, 2) == 0
    got = {}
    for kib in ("0", "1", "16", "40", "64", "1000000"):
        monkeypatch.setenv(pdl.PREFETCH_SWITCH, kib)
        got[kib] = small_gemm.prefetch_blocks(cfg, 4096, 2)
    # at least one block once set, a power of two at most the KiB asked, at most the program's 32 blocks of k
    assert got == {"0": 0, "1": 1, "16": 1, "40": 2, "64": 4, "1000000": 32}
    monkeypatch.setenv(pdl.PREFETCH_SWITCH, "64")
    # a split program's share: 32 blocks over 4 splits is 8; over 3 splits 11, held by 16
    assert small_gemm.prefetch_blocks(small_gemm.Config(64, 128, 4), 4096, 2) == 4
    monkeypatch.setenv(pdl.PREFETCH_SWITCH, "1000000")
    assert small_gemm.prefetch_blocks(small_gemm.Config(64, 128, 4), 4096, 2) == 8
    assert small_gemm.prefetch_blocks(small_gemm.Config(64, 128, 3), 4096, 2) == 16
    # a split past the k blocks runs as one program a block (the launcher's clamp)
    assert small_gemm.prefetch_blocks(small_gemm.Config(64, 128, 64), 256, 2) == 1


def test_refuses_what_it_does_not_take():
    cfg = small_gemm.Config(64, 128, 1)
    w = torch.randn(64, 256)
    assert not small_gemm.supports(torch.randn(4, 256), w, None, cfg)  # 4 rows: the GEMV's
    assert not small_gemm.supports(torch.randn(65, 256), w, None, cfg)  # past the last bucket
    assert not small_gemm.supports(torch.randn(8, 200), torch.randn(64, 200), None, cfg)  # k % block_k
    assert not small_gemm.supports(torch.randn(8, 256).half(), w, None, cfg)  # dtypes differ
    assert not small_gemm.supports(torch.randn(256, 8).t(), w, None, cfg)  # x not unit-stride in k
    assert not small_gemm.supports(torch.randn(8, 256), torch.randn(256, 64).t(), None, cfg)  # weight strided
    assert not small_gemm.supports(torch.randn(8, 256), w, torch.randn(63), cfg)
    assert small_gemm.supports(torch.randn(8, 256), w, torch.randn(64), cfg)


def test_linear_off_cuda_is_torch_linear():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 256, generator=g), torch.randn(64, 256, generator=g)
    assert torch.equal(gemv.linear(x, w), nn.functional.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_float64_every_bucket_split_and_tail(interpret, dtype):
    g = torch.Generator().manual_seed(3)
    n, k = 200, 512  # 200: a ragged last column block of 64 and of 128
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    # x rows strided: a view of a wider buffer, as a slice of the fused q|k|v output would be
    wide = torch.randn(64, k + 64, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for m in (5, 16, 17, 33, 64):
        x = wide[:m, :k]
        for cfg in (small_gemm.Config(64, 128, 1), small_gemm.Config(128, 128, 2), small_gemm.Config(64, 64, 8),
                    small_gemm.Config(64, 256, 3)):  # split 3 of 2 k blocks: clamped to 2
            for bias in (None, b):
                y = small_gemm.small_gemm(x, w, bias, cfg)
                assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
                assert _rel_l2(y, _reference(x, w, bias)) < tol, (m, cfg, bias is None)
    # every split launch left its column blocks' counters zero for the next one
    assert all(int(c.abs().sum()) == 0 for c in split_counters.buffers(small_gemm.COUNTER_OWNER))


def _gated_reference(x, w, b, dtype):
    """silu(gate) * up in float64, rounded where HF's eager MLP rounds (the gate/up outputs, the SiLU)."""
    y = _reference(x, w, b).to(dtype).double()
    gate, up = y.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).to(dtype).double() * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_matches_float64_every_bucket_split_and_tail(interpret, dtype):
    """The gated epilogue (a gate|up projection's silu(gate) * up, one launch) against float64, and against the
    plain launch followed by fused.silu_mul: every row bucket, split and bias, with a ragged column tail."""
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(6)
    inter, k = 100, 256  # 100 output columns: a ragged last block of 32 and of 64
    w = _dyadic((2 * inter, k), g, dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype)
    wide = _dyadic((64, k + 64), g, dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for m in (5, 17, 64):
        x = wide[:m, :k]
        for cfg in (small_gemm.Config(64, 128, 1), small_gemm.Config(128, 64, 2), small_gemm.Config(64, 64, 4)):
            for bias in (None, b):
                y = small_gemm.small_gemm(x, w, bias, cfg, gated=True)
                assert y.shape == (m, inter) and y.dtype == dtype and torch.isfinite(y).all()
                assert _rel_l2(y, _gated_reference(x, w, bias, dtype)) < tol, (m, cfg, bias is None)
                two_kernels = fused.silu_mul(small_gemm.small_gemm(x, w, bias, cfg))
                assert torch.equal(y, two_kernels), (m, cfg, bias is None)  # the same roundings, bit for bit
    assert all(int(c.abs().sum()) == 0 for c in split_counters.buffers(small_gemm.COUNTER_OWNER))
    with pytest.raises(ValueError, match="N even"):
        small_gemm.small_gemm(wide[:8, :k], w[:-1], None, small_gemm.Config(64, 128, 1), gated=True)


def test_gated_linear_off_the_small_gemm_is_linear_then_silu_mul():
    """Where the small GEMM was not chosen (the CPU here), gated_linear is the plain projection and the SiLU
    kernel, exactly."""
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(9, 128, generator=g), torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    assert torch.equal(gemv.gated_linear(x, w, b), fused.silu_mul(nn.functional.linear(x, w, b)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_epilogue_equals_the_projection_then_qkv_rope(interpret, dtype):
    """A q|k|v projection with RoPE in its epilogue (one launch) against the plain launch followed by
    fused.qkv_rope: every row bucket, split and bias, q, k and v heads, random positions; and the tiles whose
    half column block does not divide half a head are refused."""
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(8)
    hq, hkv, d, k = 4, 2, 64, 256
    n = (hq + 2 * hkv) * d
    w = _dyadic((n, k), g, dtype)
    b = torch.randn(n, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    wide = _dyadic((64, k + 64), g, dtype)
    for m in (5, 17, 64):
        x = wide[:m, :k]
        pos = torch.randint(0, 4096, (m,), generator=g)
        for cfg in (small_gemm.Config(64, 128, 1), small_gemm.Config(64, 64, 2), small_gemm.Config(32, 64, 4)):
            rope = small_gemm.Rope(hq, hkv, d, pos, cos, sin)
            for bias in (None, b):
                q, kk, v = small_gemm.small_gemm(x, w, bias, cfg, rope=rope)
                assert q.shape == (m, hq, d) and kk.shape == (m, hkv, d) and v.shape == (m, hkv, d)
                want = fused.qkv_rope(small_gemm.small_gemm(x, w, bias, cfg), pos, cos, sin, hq, hkv, d)
                for got, ref in zip((q, kk, v), want):
                    if dtype == torch.float32:
                        assert _rel_l2(got, ref.double()) < 1e-6, (m, cfg, bias is None)
                    else:  # the same rounded inputs; the rotation's float32 arithmetic may contract differently
                        assert _rel_l2(got, ref.double()) < 2e-3, (m, cfg, bias is None)
                # v is the projection's own rows, untouched
                plain = small_gemm.small_gemm(x, w, bias, cfg)
                assert torch.equal(v, plain[:, (hq + hkv) * d:].reshape(m, hkv, d))
    assert not small_gemm.supports(wide[:8, :k], w, None, small_gemm.Config(128, 64, 1),
                                   rope=small_gemm.Rope(hq, hkv, d, torch.zeros(8, dtype=torch.long), cos, sin))
    assert all(int(c.abs().sum()) == 0 for c in split_counters.buffers(small_gemm.COUNTER_OWNER))


def test_qkv_rope_linear_off_the_small_gemm_is_linear_then_qkv_rope():
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(6, 128, generator=g), torch.randn(8 * 32, 128, generator=g)
    cos, sin = torch.rand(64, 16, generator=g), torch.rand(64, 16, generator=g)
    pos = torch.randint(0, 64, (6,), generator=g)
    got = gemv.qkv_rope_linear(x, w, None, pos, cos, sin, 4, 2, 32)
    want = fused.qkv_rope(nn.functional.linear(x, w), pos, cos, sin, 4, 2, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_row_does_not_depend_on_its_neighbours_in_the_bucket(interpret):
    """Rows 0..19 of a 32-row call equal a 20-row call's: an eager step computes each row as its graph bucket."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(32, 256, generator=g), torch.randn(96, 256, generator=g)
    cfg = small_gemm.Config(64, 64, 2)
    assert torch.equal(small_gemm.small_gemm(x[:20], w, None, cfg), small_gemm.small_gemm(x, w, None, cfg)[:20])


def test_poisoned_partials_and_output_never_leak(interpret, monkeypatch):
    """Whatever the scratch and output memory held before (NaN here), a split launch writes every output element
    from this launch's partials only."""
    real_empty = torch.empty

    def poisoned_empty(*a, **kw):
        return real_empty(*a, **kw).fill_(float("nan"))

    monkeypatch.setattr(small_gemm.torch, "empty", poisoned_empty)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(12, 384, generator=g), torch.randn(130, 384, generator=g)
    y = small_gemm.small_gemm(x, w, None, small_gemm.Config(64, 128, 3))
    assert torch.isfinite(y).all() and _rel_l2(y, _reference(x, w, None)) < 1e-5
    y = small_gemm.small_gemm(x, w, None, small_gemm.Config(64, 128, 3), gated=True)
    assert torch.isfinite(y).all() and _rel_l2(y, _gated_reference(x, w, None, torch.float32)) < 1e-5
    # the residual epilogue's sums of squares (every block writes every row of its slot) and the norm read of them
    w_o, w_next = torch.randn(128, 384, generator=g), torch.randn(64, 128, generator=g)
    res = torch.randn(12, 128, generator=g)
    want = res.double() + _reference(x, w_o, None)
    stream, stats = small_gemm.small_gemm(x, w_o, None, small_gemm.Config(64, 128, 3), residual=res)
    assert _rel_l2(stream, want) < 1e-5 and torch.isfinite(stats).all()
    y = small_gemm.small_gemm(stream, w_next, None, small_gemm.Config(64, 64, 2),
                              norm=small_gemm.Norm(stats, torch.ones(128), 1e-6))
    normed = stream.double() * stream.double().pow(2).mean(1, keepdim=True).rsqrt()
    assert torch.isfinite(y).all() and _rel_l2(y, normed @ w_next.double().t()) < 1e-5


def test_refusal_message(interpret):
    with pytest.raises(ValueError, match="small_gemm takes"):
        small_gemm.small_gemm(torch.randn(3, 256), torch.randn(64, 256), None, small_gemm.Config(64, 128, 1))


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 1024)])
def test_gpu_matches_float64(dtype, n, k):
    from triton.runtime.errors import OutOfResources

    require_cuda()
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    for m in (5, 16, 32, 48, 64):
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
        for bias in (None, b):
            ref = _reference(x, w, bias)
            torch_err = _rel_l2(nn.functional.linear(x, w, bias), ref)
            for cfg in small_gemm.candidates(n, k, 132):
                try:
                    y = small_gemm.small_gemm(x, w, bias, cfg)
                except OutOfResources:
                    # a tile the chooser does not time at this row bucket (its stages exceed the shared memory)
                    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
                    assert small_gemm.shared_bytes(cfg, small_gemm.row_block(m)) > limit, cfg
                    continue
                # one rounding of a float32 sum: as close as cuBLAS's result, within a rounding step
                assert _rel_l2(y, ref) <= max(2 * torch_err, 4e-3), (m, cfg, bias is None)
                if n == 6144 and m in (5, 32) and 64 % (cfg.block_n // 2) == 0:  # Llama-3-8B's q|k|v with RoPE
                    from kvgen.engine import fused

                    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
                    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
                    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
                    pos = torch.randint(0, 8192, (m,), device="cuda", generator=g)
                    got = small_gemm.small_gemm(x, w, bias, cfg, rope=small_gemm.Rope(32, 8, 128, pos, cos, sin))
                    want = fused.qkv_rope(small_gemm.small_gemm(x, w, bias, cfg), pos, cos, sin, 32, 8, 128)
                    for a, r in zip(got, want):  # the same rounded projection, rotated in float32
                        assert _rel_l2(a, r.double()) <= 4e-3, (m, cfg)
                if n % 2 == 0 and m in (5, 32):  # the gated epilogue of a gate|up projection
                    y = small_gemm.small_gemm(x, w, bias, cfg, gated=True)
                    gated_ref = _gated_reference(x, w, bias, dtype)
                    torch_gated = torch.nn.functional.silu(nn.functional.linear(x, w, bias).chunk(2, -1)[0])
                    torch_gated = torch_gated * nn.functional.linear(x, w, bias).chunk(2, -1)[1]
                    assert _rel_l2(y, gated_ref) <= max(2 * _rel_l2(torch_gated, gated_ref), 8e-3), (m, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl_switch", ["0", "1"])
def test_gpu_graph_replays_new_inputs(monkeypatch, pdl_switch):
    """Captured split and unsplit launches replay with the inputs' new values, back to back (the counters each
    launch leaves zero serve the next), with and without PDL; a capture that would make its counters raises."""
    require_cuda()
    monkeypatch.setenv("KVGEN_PDL", pdl_switch)
    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(2, 32, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    cfgs = [small_gemm.Config(64, 128, 1), small_gemm.Config(64, 128, 4), small_gemm.Config(128, 128, 8)]
    static = x[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for c in cfgs:
            small_gemm.small_gemm(static, w, None, c)
        with torch.cuda.graph(graph, stream=stream):
            outs = [small_gemm.small_gemm(static, w, None, c) for c in cfgs]
    torch.cuda.current_stream().wait_stream(stream)
    for i in (1, 0, 1):
        static.copy_(x[i])
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(x[i], w, None)
        for c, out in zip(cfgs, outs):
            assert _rel_l2(out, ref) < 4e-3, (i, c)
    # a capture with no warm-up on its stream (no counters made yet) refuses rather than count into memory
    # that only the graph's replay would zero
    monkeypatch.setattr(split_counters, "_COUNTERS", {})
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            small_gemm.small_gemm(static, w, None, cfgs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_choose_keeps_only_faster_checked_kernels_and_linear_follows():
    require_cuda()
    from kvgen.engine.config import ModelConfig
    from kvgen.engine.weights import build_model, random_weights

    gemv.clear()
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=1024, hidden_size=2048, intermediate_size=4096,
                                     num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                     max_position_embeddings=512, rms_norm_eps=1e-5), "config")
    net = random_weights(build_model(cfg, 512, torch.device("cuda"), torch.bfloat16), 0)
    try:
        choices = gemv.choose(net, [8, 16, 32, 48])
        assert {c.rows for c in choices} == {16, 32, 64}  # 8 runs as 16, 48 as 64
        chained = gemv.pdl.enabled(torch.empty(0, device="cuda"))
        for c in choices:
            assert c.config is None or isinstance(c.config, small_gemm.Config)
            assert (c.config is not None) == gemv.prefers_gemv(c.gemv_ms, c.cublas_ms, chained)
        o_proj = net.model.layers[0].self_attn.o_proj
        x = torch.randn(20, 2048, device="cuda", dtype=torch.bfloat16)
        o = next(c for c in choices if c.name == "o" and c.rows == 32)
        want = (small_gemm.small_gemm(x, o_proj.weight, None, o.config) if o.config is not None
                else nn.functional.linear(x, o_proj.weight))
        assert torch.equal(gemv.linear(x, o_proj.weight), want)
    finally:
        gemv.clear()
