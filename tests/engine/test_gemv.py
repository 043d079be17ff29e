"""The small-batch GEMV (kvgen/engine/gemv.py, gemv.cu).

CPU (CI): the source builds for sm_90a with nvcc (skipped only without nvcc),
its prefetches all come before its PDL wait (SASS),
``linear`` is exactly ``nn.functional.linear`` wherever the GEMV does not run,
and the tensors it refuses are refused. GPU (``-m gpu``): every config and
row count against a float64 reference on random inputs (ragged K and N
tails, bias, fp16 and bf16), inside a CUDA graph too, the same bits with the
L2 prefetch before the PDL wait, and ``choose`` keeps only what it timed
faster and checked.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from kvgen.engine import gemv
from kvgen.runtime import cuda_loader

needs_nvcc = pytest.mark.skipif(cuda_loader.find_nvcc() is None, reason="nvcc (CUDA toolkit) not installed")


@pytest.fixture(autouse=True)
def _fresh_choices():
    gemv.clear()
    yield
    gemv.clear()


def test_prefers_gemv_only_when_faster_or_within_the_pdl_chain_margin():
    m = gemv.PDL_CHAIN_MS
    assert gemv.prefers_gemv(0.050, 0.051, chained=False)
    assert not gemv.prefers_gemv(0.0562, 0.0558, chained=False)  # cuBLAS faster alone, no chain to keep
    assert gemv.prefers_gemv(0.0562, 0.0558, chained=True)  # the measured gate/up case: GEMV keeps the chain
    assert gemv.prefers_gemv(0.050 + 0.9 * m, 0.050, chained=True)
    assert not gemv.prefers_gemv(0.050 + 1.1 * m, 0.050, chained=True)  # slower by more than the chain costs
    assert not gemv.prefers_gemv(None, 0.050, chained=True)  # no GEMV config passed its check


@needs_nvcc
def test_gemv_source_builds_for_sm_90a(tmp_path):
    lib = cuda_loader.build(gemv.SOURCE.read_text(), "sm_90a", root=tmp_path)
    assert lib.is_file() and lib.stat().st_size > 0


@needs_nvcc
def test_gemv_prefetches_only_before_its_pdl_wait(tmp_path):
    """Offline sm_90a SASS of every instance: the L2 prefetches of the rows' first lines (KVGEN_PREFETCH_KB) are
    issued before the PDL wait (griddepcontrol.wait, ACQBULK), where the kernel before may still run, never after
    it."""
    import subprocess

    from benchmarks.experiments.cuda_sass import cuobjdump
    from benchmarks.experiments.sass_text import instructions, opcode

    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither on the PATH nor in Triton's NVIDIA backend)")
    cubin = tmp_path / "gemv.cubin"
    subprocess.run([cuda_loader.find_nvcc(), "-O3", "-std=c++17", "-arch=sm_90a", "-cubin", "-o", str(cubin),
                    str(gemv.SOURCE)], check=True, capture_output=True)
    sass = subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    kernels = [f for f in sass.split("Function : ")[1:] if "gemv_kernel" in f.split("\n", 1)[0]]
    assert len(kernels) == 2 * 3 * len(gemv.CONFIGS)  # (dtype, row bucket, config)
    for body in kernels:
        ins = [i for _, i in instructions(body)]
        prefetches = [j for j, i in enumerate(ins) if opcode(i) == "CCTL" and ".PF" in i]
        waits = [j for j, i in enumerate(ins) if opcode(i) == "ACQBULK"]
        assert prefetches and waits and max(prefetches) < min(waits), body.split("\n", 1)[0]


def test_linear_off_cuda_is_torch_linear():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    assert not gemv.supports(x, w, b)
    assert torch.equal(gemv.linear(x, w, b), nn.functional.linear(x, w, b))
    with pytest.raises(ValueError, match="gemv takes"):
        gemv.gemv(x, w, b)


def test_choose_does_nothing_off_cuda():
    from kvgen.engine.config import ModelConfig
    from kvgen.engine.weights import build_model, random_weights

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=128, rms_norm_eps=1e-5), "config")
    net = random_weights(build_model(cfg, 128, torch.device("cpu"), torch.float32), 0)
    groups = dict(gemv.weight_groups(net))
    assert list(groups) == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert all(len(groups[name]) == 2 for name in ("qkv", "o", "gate_up", "down"))
    head = net.model.embed_tokens.weight if net.lm_head is None else net.lm_head.weight
    assert len(groups["lm_head"]) == 1 and groups["lm_head"][0][0] is head
    assert gemv.choose(net, [1, 2, 4]) == []


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _rel_l2(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1352), (7, 264)])  # K % 256 != 0 and N % 16 != 0 tails
def test_gemv_matches_float64(dtype, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    for m in range(1, gemv.MAX_ROWS + 1):
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
        for bias in (None, b):
            ref = _reference(x, w, bias)
            torch_err = _rel_l2(nn.functional.linear(x, w, bias), ref)
            for config in range(len(gemv.CONFIGS)):
                y = gemv.gemv(x, w, bias, config)
                assert y.shape == (m, n) and y.dtype == dtype
                assert torch.isfinite(y).all()
                # one rounding of a float32 sum: as close as cuBLAS's result, within a rounding step
                assert _rel_l2(y, ref) <= max(2 * torch_err, 4e-3), (m, config, bias is None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_rows_are_independent_of_the_row_count_and_capturable():
    """A row's result does not depend on how many rows ran beside it (eager 3 rows = graph bucket 4), and a
    captured call replays with the inputs' new values."""
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    for config in range(len(gemv.CONFIGS)):
        assert torch.equal(gemv.gemv(x[:3], w, None, config), gemv.gemv(x, w, None, config)[:3])
    static = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.gemv(static, w)
        with torch.cuda.graph(graph, stream=stream):
            out = gemv.gemv(static, w)
    torch.cuda.current_stream().wait_stream(stream)
    static.copy_(x[3:4])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv.gemv(x[3:4], w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_prefetch_changes_no_bit(monkeypatch):
    """The L2 prefetch before the PDL wait (``KVGEN_PREFETCH_KB``, up to more than a whole row) computes exactly
    what the launch without it does, every config, eager and in a chain of captured launches."""
    from kvgen.engine import pdl

    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(1000, 1352, device="cuda", dtype=torch.bfloat16, generator=g)  # ragged k and n tails
    x = torch.randn(4, 1352, device="cuda", dtype=torch.bfloat16, generator=g)
    monkeypatch.delenv(pdl.PREFETCH_SWITCH, raising=False)
    want = [gemv.gemv(x[:m], w, None, c) for m in (1, 4) for c in range(len(gemv.CONFIGS))]
    for kib in ("1", "16", "4096"):
        monkeypatch.setenv(pdl.PREFETCH_SWITCH, kib)
        got = [gemv.gemv(x[:m], w, None, c) for m in (1, 4) for c in range(len(gemv.CONFIGS))]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), kib
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                chain = [gemv.gemv(x[:1], w, None, c) for c in range(len(gemv.CONFIGS))]
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(chain, want[:len(gemv.CONFIGS)])), kib


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_choose_keeps_only_faster_checked_gemvs_and_linear_follows():
    from kvgen.engine.config import ModelConfig
    from kvgen.engine.weights import build_model, random_weights

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=1024, hidden_size=2048, intermediate_size=4096,
                                     num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                     max_position_embeddings=512, rms_norm_eps=1e-5), "config")
    net = random_weights(build_model(cfg, 512, torch.device("cuda"), torch.bfloat16), 0)
    choices = gemv.choose(net, [1, 2, 3, 4, 8])
    # 3 runs as 4; 8 as the small GEMM's bucket of 16 (a Triton kernel: not under the interpreter)
    rows = {1, 2, 4} if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else {1, 2, 4, 16}
    assert {c.rows for c in choices} == rows
    assert len(choices) == 5 * len(rows)  # five groups at each
    for c in choices:
        chained = gemv.pdl.enabled(torch.empty(0, device="cuda"))
        assert c.cublas_ms > 0 and (c.config is not None) == gemv.prefers_gemv(c.gemv_ms, c.cublas_ms, chained)
    attn = net.model.layers[0].self_attn
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    qkv = next(c for c in choices if c.name == "qkv" and c.rows == 1)
    want = (gemv.gemv(x, attn.qkv_weight, attn.qkv_bias, qkv.config) if qkv.config is not None
            else nn.functional.linear(x, attn.qkv_weight, attn.qkv_bias))
    assert torch.equal(gemv.linear(x, attn.qkv_weight, attn.qkv_bias), want)
    gemv.clear()
    assert torch.equal(gemv.linear(x, attn.qkv_weight, attn.qkv_bias),
                       nn.functional.linear(x, attn.qkv_weight, attn.qkv_bias))


def test_a_remembered_choice_is_used_only_while_it_is_offered_and_checks_out(tmp_path):
    """gemv._recall, on the CPU: cuBLAS comes back without a run; a kernel config only if today's candidates
    hold it and its output matches cuBLAS's (not a wrong, NaN or failing one); nothing without a store."""
    from kvgen.engine import projection_store as ps
    from kvgen.runtime.autotune import Autotuner

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 64), torch.randn(32, 64), torch.randn(32)
    want = nn.functional.linear(x, w, b)
    ran = []

    def good(x, w, b):
        ran.append("good")
        return nn.functional.linear(x, w, b)

    def fail(x, w, b):
        raise RuntimeError("no such kernel here")
    runs = {0: good, 1: lambda x, w, b: want * 1.5, 2: lambda x, w, b: want * float("nan"), 3: fail}
    saved = ps.ProjectionStore(Autotuner("cpu", directory=tmp_path, progress=False), {"t": 1})
    key = ps.key("o", (32, 64), torch.float32, True, 2, False)
    assert gemv._recall(None, key, runs, x, w, b, want) is None
    assert gemv._recall(saved, key, runs, x, w, b, want) is None  # nothing remembered yet
    saved.remember(key, None, 0.013, 0.015)
    assert gemv._recall(saved, key, runs, x, w, b, want) == (None, 0.013, 0.015) and ran == []
    saved.remember(key, 0, 0.013, 0.011)
    assert gemv._recall(saved, key, runs, x, w, b, want) == (0, 0.013, 0.011) and ran == ["good"]
    for distrusted in (1, 2, 3, 7):  # wrong output, NaN, a launch failure, a config no longer offered
        saved.remember(key, distrusted, 0.013, 0.011)
        assert gemv._recall(saved, key, runs, x, w, b, want) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_choose_remembers_its_decisions_for_a_later_start(tmp_path, monkeypatch):
    """A second start with the same store times nothing and decides the same; a remembered choice whose output
    no longer checks out against cuBLAS is timed afresh."""
    from kvgen.engine.config import ModelConfig
    from kvgen.engine.weights import build_model, random_weights
    from kvgen.runtime import kernel_timer

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVGEN_AUTOTUNE", raising=False)  # "off" would read nothing back
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=1024, hidden_size=2048, intermediate_size=4096,
                                     num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                                     max_position_embeddings=512, rms_norm_eps=1e-5), "config")
    net = random_weights(build_model(cfg, 512, torch.device("cuda"), torch.bfloat16), 0)
    rows = [1, 2, 8]
    first = gemv.choose(net, rows, saved=gemv.store(torch.device("cuda")))
    assert first and list((tmp_path / "autotune").glob("projections-*.json"))

    def no_timing(fn):
        raise AssertionError("a remembered decision was timed again")
    monkeypatch.setattr(kernel_timer, "graph_time_ms", no_timing)
    gemv.clear()
    again = gemv.choose(net, rows, saved=gemv.store(torch.device("cuda")))
    assert [(c.name, c.rows, c.config, c.cublas_ms, c.gemv_ms) for c in again] == \
           [(c.name, c.rows, c.config, c.cublas_ms, c.gemv_ms) for c in first]
    # a remembered kernel choice whose output no longer checks out against cuBLAS's is timed afresh
    if all(c.config is None for c in first):
        pytest.skip("cuBLAS won every shape on this GPU: no remembered kernel choice to distrust")
    monkeypatch.setattr(gemv, "_rel_l2", lambda a, b: 1.0)  # every output check fails
    gemv.clear()
    with pytest.raises(AssertionError, match="timed again"):
        gemv.choose(net, rows, saved=gemv.store(torch.device("cuda")))
