"""The small GEMM's residual epilogue and RMSNorm prologue (kvgen/engine/small_gemm_kernel.py RESIDUAL, NORM) and
their place in the model's projections (gemv.residual_linear, gemv.DeferredNorm).

CPU (CI, Triton interpreter, float32/float16): o adding into the residual
stream, then gate/up, q/k/v or a plain projection normalizing it on the way
in, against the add + RMSNorm kernel between plain launches, every row
bucket, split and bias; the refusals; the fallbacks where the small GEMM does
not run. GPU (``-m gpu``): Llama-3-8B's shapes, and the chain captured in a
CUDA graph and replayed with new inputs, with and without PDL.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvgen.engine import gemv, pdl, small_gemm
from kvgen.runtime import split_counters
from tests.kernels.harness import require_cuda

from .test_small_gemm import _rel_l2, interpret  # noqa: F401  (interpret: the interpreter-only fixture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_epilogue_then_norm_prologue_equal_add_rms_norm_then_the_projection(interpret, dtype):
    """o (or down) adding into the residual stream in its epilogue, then q/k/v, gate/up or a plain projection
    normalizing that stream on the way in, against the add + RMSNorm kernel between two plain launches: every row
    bucket, split and bias. The residual is the same bit for bit; the normalized projection differs by the sum of
    squares' order only (float16: a rounding here and there, float32: ~1e-7)."""
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(10)
    hidden, k_in, eps = 192, 128, 1e-5
    w_o = (torch.randn(hidden, k_in, generator=g) / 8).to(dtype)
    b_o = torch.randn(hidden, generator=g).to(dtype)
    gain = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    w_next = (torch.randn(160, hidden, generator=g) / 8).to(dtype)
    b_next = torch.randn(160, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for m in (5, 17, 64):
        x = torch.randn(m, k_in, generator=g).to(dtype)
        res = torch.randn(m, hidden, generator=g).to(dtype)
        for cfg in (small_gemm.Config(64, 64, 1), small_gemm.Config(128, 64, 2)):
            for bias in (None, b_o):
                stream = res.clone()
                out, stats = small_gemm.small_gemm(x, w_o, bias, cfg, residual=stream)
                assert out is stream and stats.shape == (-(-hidden // cfg.block_n), small_gemm.row_block(m))
                normed, added = fused.add_rms_norm(small_gemm.small_gemm(x, w_o, bias, cfg), res.clone(), gain, eps)
                assert torch.equal(stream, added), (m, cfg, bias is None)
                squares = stream.double().pow(2)
                per_block = torch.stack([squares[:, j:j + cfg.block_n].sum(1)
                                         for j in range(0, hidden, cfg.block_n)])
                assert torch.allclose(stats[:, :m].double(), per_block, rtol=1e-5), (m, cfg)
                norm = small_gemm.Norm(stats, gain, eps)
                for nxt in (small_gemm.Config(64, 64, 1), small_gemm.Config(64, 64, 3)):
                    y = small_gemm.small_gemm(stream, w_next, b_next, nxt, norm=norm)
                    want = small_gemm.small_gemm(normed, w_next, b_next, nxt)
                    assert _rel_l2(y, want.double()) < tol, (m, cfg, nxt)
                    gated = small_gemm.small_gemm(stream, w_next, None, nxt, gated=True, norm=norm)
                    assert _rel_l2(gated, small_gemm.small_gemm(normed, w_next, None, nxt, gated=True).double()) < tol
    assert all(int(c.abs().sum()) == 0 for c in split_counters.buffers(small_gemm.COUNTER_OWNER))


def test_residual_and_norm_refusals(interpret):
    """What the residual epilogue and the norm prologue do not take: an epilogue besides the residual, a residual
    sharing x's storage or of the wrong shape, stats of another row bucket or too many blocks, a norm weight of
    the wrong length, a residual and a norm in one launch."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(8, 128, generator=g), torch.randn(64, 128, generator=g)
    cfg = small_gemm.Config(64, 64, 1)
    res = torch.randn(8, 64, generator=g)
    assert small_gemm.supports(x, w, None, cfg, residual=res)
    assert not small_gemm.supports(x, torch.randn(128, 128), None, cfg, gated=True, residual=torch.randn(8, 128))
    assert not small_gemm.supports(x, w, None, cfg, residual=torch.randn(8, 65))
    both = torch.randn(8, 192)
    assert not small_gemm.supports(both[:, :128], w, None, cfg, residual=both[:, 128:])
    gain = torch.rand(128, generator=g)
    assert small_gemm.supports(x, w, None, cfg, norm=small_gemm.Norm(torch.rand(4, 16), gain, 1e-6))
    assert not small_gemm.supports(x, w, None, cfg, norm=small_gemm.Norm(torch.rand(4, 32), gain, 1e-6))
    assert not small_gemm.supports(x, w, None, cfg, norm=small_gemm.Norm(torch.rand(small_gemm.MAX_STATS + 1, 16),
                                                                          gain, 1e-6))
    assert not small_gemm.supports(x, w, None, cfg, norm=small_gemm.Norm(torch.rand(4, 16), gain[:64], 1e-6))
    # a residual launch writes stats of its own: not while reading a norm's
    assert not small_gemm.supports(x, w, None, cfg, norm=small_gemm.Norm(torch.rand(4, 16), gain, 1e-6), residual=res)
    with pytest.raises(ValueError, match="a residual"):
        small_gemm.small_gemm(both[:, :128], w, None, cfg, residual=both[:, 128:])


def test_deferred_norm_off_the_small_gemm_is_the_norm_kernel_then_the_projection(monkeypatch):
    """Where the small GEMM was not chosen (the CPU here), a DeferredNorm input is the RMSNorm kernel's output,
    exactly, for linear, gated_linear and qkv_rope_linear; residual_linear declines (the caller adds)."""
    from kvgen.engine import fused

    g = torch.Generator().manual_seed(12)
    h, gain = torch.randn(6, 128, generator=g), torch.rand(128, generator=g) + 0.5
    deferred = gemv.DeferredNorm(h, small_gemm.Norm(torch.rand(2, 16, generator=g), gain, 1e-5))
    normed = fused.rms_norm(h, gain, 1e-5)
    w, b = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    assert torch.equal(gemv.linear(deferred, w, b), nn.functional.linear(normed, w, b))
    assert torch.equal(gemv.gated_linear(deferred, w, b), fused.silu_mul(nn.functional.linear(normed, w, b)))
    w_qkv = torch.randn(8 * 32, 128, generator=g)
    cos, sin = torch.rand(64, 16, generator=g), torch.rand(64, 16, generator=g)
    pos = torch.randint(0, 64, (6,), generator=g)
    got = gemv.qkv_rope_linear(deferred, w_qkv, None, pos, cos, sin, 4, 2, 32)
    want = fused.qkv_rope(nn.functional.linear(normed, w_qkv), pos, cos, sin, 4, 2, 32)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    monkeypatch.setattr(gemv, "FUSED_NORM", True)  # declines because no small GEMM was chosen, not because it is off
    assert gemv.residual_linear(torch.randn(6, 96, generator=g), torch.randn(128, 96, generator=g), None, h) is None


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_residual_then_norm_at_llama_shapes(dtype):
    """Llama-3-8B's down projection adding into the residual stream, then gate/up (gated) and q/k/v (RoPE) with
    the RMSNorm in their prologue, every candidate tile that fits, against the add + RMSNorm kernel between plain
    launches: the stream bit for bit, the projections within a rounding step."""
    from triton.runtime.errors import OutOfResources

    from kvgen.engine import fused

    require_cuda()
    g = torch.Generator(device="cuda").manual_seed(13)
    hidden, inter = 4096, 14336
    w_down = torch.randn(hidden, inter, device="cuda", dtype=dtype, generator=g) / 64
    w_gu = torch.randn(2 * inter, hidden, device="cuda", dtype=dtype, generator=g) / 64
    w_qkv = torch.randn(6144, hidden, device="cuda", dtype=dtype, generator=g) / 64
    gain = torch.rand(hidden, device="cuda", dtype=dtype, generator=g) + 0.5
    pos = torch.randint(0, 4096, (32,), device="cuda", generator=g)
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    tried = 0
    for m in (5, 32):
        x = torch.randn(m, inter, device="cuda", dtype=dtype, generator=g)
        res = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=g)
        for cfg in small_gemm.candidates(hidden, inter, 132):
            stream = res.clone()
            try:
                _, stats = small_gemm.small_gemm(x, w_down, None, cfg, residual=stream)
            except OutOfResources:
                continue
            normed, added = fused.add_rms_norm(small_gemm.small_gemm(x, w_down, None, cfg), res.clone(), gain, 1e-5)
            assert torch.equal(stream, added), (m, cfg)
            norm = small_gemm.Norm(stats, gain, 1e-5)
            rope = small_gemm.Rope(32, 8, 128, pos[:m], cos, sin)
            runs = [(nxt, dict(gated=True), w_gu) for nxt in small_gemm.candidates(2 * inter, hidden, 132)[:3]]
            runs += [(nxt, dict(rope=rope), w_qkv) for nxt in small_gemm.candidates(6144, hidden, 132)[:3]
                     if small_gemm.supports(stream, w_qkv, None, nxt, rope=rope, norm=norm)]
            for nxt, epilogue, w in runs:
                try:
                    got = small_gemm.small_gemm(stream, w, None, nxt, norm=norm, **epilogue)
                except OutOfResources:
                    continue
                want = small_gemm.small_gemm(normed, w, None, nxt, **epilogue)
                tried += 1
                for a, c in zip(*((got, want) if "rope" in epilogue else ((got,), (want,)))):
                    assert _rel_l2(a, c.double()) < 4e-3, (m, cfg, nxt, epilogue.keys())
    assert tried >= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl_switch,prefetch_kb", [("0", "0"), ("1", "0"), ("1", "64")])
def test_gpu_graph_replays_a_residual_and_norm_chain(monkeypatch, pdl_switch, prefetch_kb):
    """A layer's chain as the decode graphs launch it -- o adding into the residual stream, gate/up normalizing it
    on the way in, down adding, a plain projection normalizing -- captured once and replayed with new inputs, with
    and without PDL (and with the L2 prefetch before its wait), against eager launches with the add + RMSNorm
    kernel between them, and bit for bit against the same chain launched eagerly without the prefetch."""
    from kvgen.engine import fused

    require_cuda()
    monkeypatch.setenv("KVGEN_PDL", pdl_switch)
    monkeypatch.setenv(pdl.PREFETCH_SWITCH, prefetch_kb)
    g = torch.Generator(device="cuda").manual_seed(14)
    bf = torch.bfloat16
    hidden, inter = 4096, 2048
    w_o = torch.randn(hidden, hidden, device="cuda", dtype=bf, generator=g) / 64
    w_gu = torch.randn(2 * inter, hidden, device="cuda", dtype=bf, generator=g) / 64
    w_down = torch.randn(hidden, inter, device="cuda", dtype=bf, generator=g) / 64
    w_next = torch.randn(1024, hidden, device="cuda", dtype=bf, generator=g) / 64
    gains = torch.rand(2, hidden, device="cuda", dtype=bf, generator=g) + 0.5
    cfg_o, cfg_gu = small_gemm.Config(64, 128, 2), small_gemm.Config(128, 64, 1)
    cfg_down, cfg_next = small_gemm.Config(64, 128, 4), small_gemm.Config(64, 128, 2)
    inputs = torch.randn(2, 32, hidden, device="cuda", dtype=bf, generator=g)
    streams = torch.randn(2, 32, hidden, device="cuda", dtype=bf, generator=g)
    x, res = inputs[0].clone(), streams[0].clone()

    def chain():
        res_work = res.clone()
        _, stats = small_gemm.small_gemm(x, w_o, None, cfg_o, residual=res_work)
        act = small_gemm.small_gemm(res_work, w_gu, None, cfg_gu, gated=True,
                                    norm=small_gemm.Norm(stats, gains[0], 1e-5))
        _, stats = small_gemm.small_gemm(act, w_down, None, cfg_down, residual=res_work)
        return res_work, small_gemm.small_gemm(res_work, w_next, None, cfg_next,
                                               norm=small_gemm.Norm(stats, gains[1], 1e-5))

    def with_norm_kernel(xi, ri):
        normed, stream = fused.add_rms_norm(small_gemm.small_gemm(xi, w_o, None, cfg_o), ri.clone(), gains[0], 1e-5)
        act = small_gemm.small_gemm(normed, w_gu, None, cfg_gu, gated=True)
        normed, stream = fused.add_rms_norm(small_gemm.small_gemm(act, w_down, None, cfg_down), stream, gains[1],
                                            1e-5)
        return stream, small_gemm.small_gemm(normed, w_next, None, cfg_next)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        chain()  # warm-up on the capture stream: compiles, and makes its arrival counters
        with torch.cuda.graph(graph, stream=side):
            out_stream, out = chain()
    torch.cuda.current_stream().wait_stream(side)
    for i in (1, 0, 1):
        x.copy_(inputs[i])
        res.copy_(streams[i])
        graph.replay()
        torch.cuda.synchronize()
        want_stream, want = with_norm_kernel(inputs[i], streams[i])
        assert _rel_l2(out_stream, want_stream.double()) < 4e-3, i
        assert _rel_l2(out, want.double()) < 8e-3, i
        with monkeypatch.context() as m:
            m.delenv(pdl.PREFETCH_SWITCH)
            eager_stream, eager = chain()  # the same kernels: a prefetch changes no arithmetic (nor the split order)
        assert torch.equal(out_stream, eager_stream) and torch.equal(out, eager), i
