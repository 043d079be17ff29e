"""The fused elementwise kernels (kvgen.engine.fused) against float64 references.

Each case runs both implementations: the Triton kernels (on the CPU
interpreter here, which the conftest turns on) and the plain-torch
fallback (``KVGEN_FUSED_TORCH=1``). Inputs are random and nonzero; the
outputs the functions allocate are poisoned with NaN (the ``poisoned``
fixture fills what ``torch.empty`` returns), so an element a kernel forgets
to write fails.
On a GPU (``KVGEN_TEST_DEVICE=cuda``) the same tests run the compiled
kernels, bfloat16 included.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvgen.engine import fused
from kvgen.engine.config import ModelConfig
from kvgen.engine.rope import Rotary, inv_frequencies

DEVICE = torch.device(os.environ.get("KVGEN_TEST_DEVICE", "cpu"))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])  # never bf16 interpreted
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(params=["triton", "torch"])
def impl(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("KVGEN_FUSED_TORCH", "1")
    else:
        monkeypatch.delenv("KVGEN_FUSED_TORCH", raising=False)
    assert fused.use_triton(torch.empty(1, device=DEVICE)) == (request.param == "triton")
    return request.param


@pytest.fixture
def poisoned(monkeypatch):
    """``torch.empty`` returns NaN-filled float tensors for the test (the outputs the fused functions allocate)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = torch.where(x.abs() < 0.05, 0.05 + x.abs(), x)  # never zero
    return x.to(device=DEVICE, dtype=dtype)


def _ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# (T, Hq, Hkv, D): a decode token, odd token counts, GQA and MHA, a head_dim whose half is not a power of 2
QKV_CASES = [(1, 4, 2, 16), (7, 6, 2, 12), (37, 3, 3, 8), (5, 8, 1, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("T,Hq,Hkv,D", QKV_CASES)
def test_qkv_rope(impl, poisoned, dtype, qk_norm, T, Hq, Hkv, D):
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=Hq * D, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=Hq, num_key_value_heads=Hkv,
                                     head_dim=D, rope_theta=500000.0,
                                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0, original_max_position_embeddings=16)))
    rot = Rotary(cfg, 300, DEVICE)
    width = (Hq + 2 * Hkv) * D
    wide = _rand(T, width + 5, dtype=dtype, seed=T + D)  # rows with a stride beyond the width (a GEMM slice)
    qkv = wide[:, 3:3 + width]
    before = qkv.clone()
    pos = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(D)).to(DEVICE)
    qw, kw = (_rand(D, dtype=dtype, seed=1), _rand(D, dtype=dtype, seed=2)) if qk_norm else (None, None)
    q, k, v = fused.qkv_rope(qkv, pos, rot.cos, rot.sin, Hq, Hkv, D, qw, kw, eps=1e-6)
    assert q.shape == (T, Hq, D) and k.shape == v.shape == (T, Hkv, D)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(qkv, before)  # only read

    rq, rk, rv = qkv.double().split((Hq * D, Hkv * D, Hkv * D), dim=-1)
    rq, rk, rv = rq.reshape(T, Hq, D), rk.reshape(T, Hkv, D), rv.reshape(T, Hkv, D)
    if qk_norm:
        rq, rk = _ref_norm(rq, qw, 1e-6), _ref_norm(rk, kw, 1e-6)
    c, s = rot.cos[pos], rot.sin[pos]
    torch.testing.assert_close(q.double(), _ref_rope(rq, c, s), **TOL[dtype])
    torch.testing.assert_close(k.double(), _ref_rope(rk, c, s), **TOL[dtype])
    assert torch.equal(v, qkv[:, (Hq + Hkv) * D:].reshape(T, Hkv, D))  # v is a plain copy


def test_rotary_tables_are_the_scaled_frequencies():
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8,
                                     num_hidden_layers=1, num_attention_heads=2, rope_theta=10000.0,
                                     rope_scaling=dict(rope_type="linear", factor=2.0)))
    rot = Rotary(cfg, 1000, torch.device("cpu"))
    inv = inv_frequencies(cfg).double()
    assert rot.cos.shape == rot.sin.shape == (1000, 16) and rot.cos.dtype == torch.float32
    angles = torch.arange(1000, dtype=torch.float64)[:, None] * inv[None, :]
    torch.testing.assert_close(rot.cos.double(), angles.cos(), atol=2e-4, rtol=0)
    torch.testing.assert_close(rot.sin.double(), angles.sin(), atol=2e-4, rtol=0)
    assert math.isclose(float(inv[1]), 0.5 * 10000.0 ** (-2 / 32), rel_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (7, 100), (33, 576), (2, 4096)])
def test_add_rms_norm(impl, dtype, T, N):
    x, r = _rand(T, N, dtype=dtype, seed=N), _rand(T, N, dtype=dtype, seed=N + 1)
    w = _rand(N, dtype=dtype, seed=3)
    want_res = x + r  # rounded to the model dtype, as HF adds
    want = _ref_norm(want_res, w, 1e-5)
    out, res = fused.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])

    first, kept = fused.add_rms_norm(x, None, w, 1e-5)  # the first layer: no residual yet
    assert kept is x
    torch.testing.assert_close(first.double(), _ref_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 12), (1, 2048)])
def test_rms_norm(impl, poisoned, dtype, shape):
    x, w = _rand(*shape, dtype=dtype, seed=len(shape)), _rand(shape[-1], dtype=dtype, seed=9)
    got = fused.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), _ref_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 48), (5, 100), (19, 1500)])
def test_silu_mul(impl, poisoned, dtype, T, inter):
    wide = _rand(T, 2 * inter + 3, dtype=dtype, seed=inter)
    gate_up = wide[:, :2 * inter]  # a row stride beyond the width
    got = fused.silu_mul(gate_up)
    assert got.shape == (T, inter) and got.dtype == dtype
    g, u = gate_up.double().split(inter, dim=-1)
    torch.testing.assert_close(got.double(), g * torch.sigmoid(g) * u, **TOL[dtype])


def test_empty_step_launches_nothing(impl):
    q, k, v = fused.qkv_rope(torch.empty(0, 32, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE),
                             torch.ones(4, 4, device=DEVICE), torch.zeros(4, 4, device=DEVICE), 2, 1, 8)
    assert q.shape == (0, 2, 8) and v.shape == (0, 1, 8)
    assert fused.silu_mul(torch.empty(0, 10, device=DEVICE)).shape == (0, 5)


def test_torch_runs_where_the_kernels_cannot(monkeypatch):
    monkeypatch.delenv("KVGEN_FUSED_TORCH", raising=False)
    # the runtime's rule: compiled on a GPU, interpreted on the CPU (the conftest interprets on CPU runs)
    assert fused.use_triton(torch.empty(1, device=DEVICE))
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter: torch
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # GPU tensors are never interpreted
    assert not fused.use_triton(torch.empty(1, device=DEVICE))
    assert not fused.use_triton(torch.empty(1, device="meta"))
