"""The executor's dense parts equal Hugging Face's: tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints.

Attention here is a plain causal SDPA (one sequence), so these tests check
weights, norms, RoPE (llama3 scaling included), biases, q/k norms and tied
or separate heads; the runtime's attention is compared with HF end to end
in test_generate.py. The dense parts run both ways: through the fused
kernels (kvgen.engine.fused, on the Triton interpreter here) and through
their plain-torch fallback.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvgen.engine import fused  # noqa: E402
from kvgen.engine.config import ModelConfig  # noqa: E402
from kvgen.engine.errors import EngineError  # noqa: E402
from kvgen.engine.rope import inv_frequencies  # noqa: E402
from kvgen.engine.weights import build_model, load_weights, random_weights  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
CASES = {
    "llama3": dict(model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=16)),
    "llama-tied-linear": dict(model_type="llama", tie_word_embeddings=True,
                              rope_scaling=dict(rope_type="linear", factor=2.0)),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=16),
}


def sdpa_attend(layer, q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                           v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def _small_gemm_everywhere(monkeypatch) -> dict:
    """Every projection of 5..64 rows runs the small GEMM (on the interpreter), as the decode graphs' choices make
    it run on a GPU: its epilogues (gated, RoPE, residual) and the deferred norm's prologue (``gemv.FUSED_NORM``
    on). Returns the launch counts by kind."""
    from kvgen.engine import gemv, small_gemm

    counts = {"plain": 0, "residual": 0, "norm": 0}
    launch = small_gemm.launch_supported

    def counted(x, w, b, config, **kw):
        counts["residual" if kw.get("residual") is not None else "norm" if kw.get("norm") else "plain"] += 1
        return launch(x, w, b, config, interpret=True, **kw)

    cfg = small_gemm.Config(16, 16, 2)  # a split: the partials' path too

    def chosen(x, w, b):
        return cfg if small_gemm.supports(x, w, b, cfg) else None

    monkeypatch.setattr(gemv, "_chosen", chosen)
    monkeypatch.setattr(small_gemm, "launch_supported", counted)
    monkeypatch.setattr(gemv, "FUSED_NORM", True)  # off by default (measured slower); its arithmetic still holds
    return counts


@pytest.mark.parametrize("impl", ["fused", "torch", "small-gemm"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_transformers(name, impl, tmp_path, monkeypatch):
    if impl == "torch":
        monkeypatch.setenv("KVGEN_FUSED_TORCH", "1")
    assert fused.use_triton(torch.empty(1)) == (impl != "torch")
    counts = _small_gemm_everywhere(monkeypatch) if impl == "small-gemm" else None
    raw = {**BASE, **CASES[name]}
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # biases and norm weights too: every tensor must be loaded into its place
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_folder(tmp_path)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3")
    model = load_weights(build_model(cfg, 64, torch.device("cpu"), torch.float32), tmp_path)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    ours = model.logits(model(ids, torch.arange(40), sdpa_attend))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    if counts is not None:  # o and down added into the residual stream; the norms after them deferred
        layers = cfg.num_layers
        assert counts["residual"] == 2 * layers and counts["norm"] == 2 * layers - 1, counts


@pytest.mark.parametrize("on_small_gemm", [("o",), ("down",), ("o", "down"), ("o", "gate_up"), ("down", "qkv"),
                                           ("qkv", "o", "gate_up", "down")])
def test_norm_in_the_small_gemm_float16_any_mix_with_other_kernels(on_small_gemm, monkeypatch):
    """float16 (every rounding real), the small GEMM (interpreter) running only some projections, as a GPU's
    choices may leave others to cuBLAS: against the same choices with the residual add + RMSNorm kernel. Where no
    projection after o or down takes the deferred norm, the norm kernel runs and the logits are the same bit for
    bit; where one does, they differ by the sum of squares' order only."""
    from kvgen.engine import gemv, small_gemm

    cfg = ModelConfig.from_dict({**BASE, "model_type": "llama", "head_dim": 16, "tie_word_embeddings": False})
    torch.manual_seed(2)
    model = random_weights(build_model(cfg, 64, torch.device("cpu"), torch.float16))
    groups = dict(gemv.weight_groups(model))
    chosen_ptrs = {w.data_ptr() for name in on_small_gemm for w, _ in groups[name]}
    config = small_gemm.Config(16, 16, 2)
    launched = {"norm": 0}
    launch = small_gemm.launch_supported

    def counted(x, w, b, cfg_, **kw):
        launched["norm"] += kw.get("norm") is not None
        return launch(x, w, b, cfg_, interpret=True, **kw)

    monkeypatch.setattr(gemv, "_chosen", lambda x, w, b: config if w.data_ptr() in chosen_ptrs else None)
    monkeypatch.setattr(small_gemm, "launch_supported", counted)
    monkeypatch.setattr(gemv, "FUSED_NORM", True)  # off by default (measured slower); its arithmetic still holds
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
    fused_logits = model.logits(model(ids, torch.arange(12), sdpa_attend))
    norms = launched["norm"]
    residual_linear = gemv.residual_linear
    monkeypatch.setattr(gemv, "residual_linear", lambda *a, **k: None)
    kernel_logits = model.logits(model(ids, torch.arange(12), sdpa_attend))
    monkeypatch.setattr(gemv, "residual_linear", residual_linear)
    deferred = ("o" in on_small_gemm and "gate_up" in on_small_gemm) or ("down" in on_small_gemm
                                                                         and "qkv" in on_small_gemm)
    assert (norms > 0) == deferred
    assert torch.isfinite(fused_logits).all()
    if deferred:
        err = float((fused_logits - kernel_logits).double().norm() / kernel_logits.double().norm())
        assert err < 1e-2, err
    else:
        assert torch.equal(fused_logits, kernel_logits)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**BASE, **CASES["llama3"], "head_dim": 64}
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(inv_frequencies(ModelConfig.from_dict(raw)), ref.float())


def test_random_weights_and_config_errors():
    cfg = ModelConfig.from_dict({**BASE, "model_type": "qwen2"})
    m = random_weights(build_model(cfg, 16, torch.device("cpu"), torch.bfloat16))
    assert m.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert m.model.layers[0].self_attn.q_proj.bias is not None
    assert float(m.model.norm.weight.float().mean()) == 1.0
    with pytest.raises(EngineError, match="model_type 'gpt2'"):
        ModelConfig.from_dict({**BASE, "model_type": "gpt2"})
    with pytest.raises(EngineError, match="yarn"):
        ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(EngineError, match="lacks hidden_size"):
        ModelConfig.from_dict({k: v for k, v in {**BASE, "model_type": "llama"}.items() if k != "hidden_size"})
