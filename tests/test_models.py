"""ModelSpec presets, config loading, parameter counts and the errors users see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgen.errors import KvgenError, ModelConfigError, UnknownModelError
from kvgen.models import ModelSpec, count_params, list_models, resolve_model

# Published parameter counts (model cards / safetensors index totals).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "mixtral-8x7b": 46_702_792_704,
}

# The config.json fields of the published checkpoints, as a user would pass them.
CONFIGS = {
    "llama-2-7b": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=32, hidden_size=4096,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=32, hidden_size=4096,
                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_hidden_layers=32, hidden_size=4096,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                         max_position_embeddings=32768, rope_theta=1e6, sliding_window=None, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),
}


def write_config(directory: Path, cfg: dict, name: str = "config.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(cfg))
    return path


def test_llama_2_70b_shape():
    m = resolve_model("llama-2-70b")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.num_q_heads) == (80, 8, 128, 64)
    assert m.gqa_group == 8


def test_llama_3_8b_shape():
    m = resolve_model("llama-3-8b")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.rope_theta) == (32, 8, 128, 500000.0)
    assert m.num_params == 8_030_261_248


def test_gemma_2_9b_head_dim_is_not_hidden_over_heads():
    m = resolve_model("gemma-2-9b")
    assert m.head_dim == 256 and m.hidden_size // m.num_q_heads == 224
    assert (m.num_q_heads, m.num_kv_heads, m.sliding_window) == (16, 8, 4096)


def test_other_preset_facts():
    assert resolve_model("mistral-7b").sliding_window == 4096
    mix = resolve_model("mixtral-8x7b")
    assert (mix.num_experts, mix.num_experts_per_tok) == (8, 2)
    smol = resolve_model("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_q_heads, smol.num_kv_heads, smol.head_dim) == (30, 576, 9, 3, 64)
    assert (smol.vocab_size, smol.rope_theta, smol.tied_embeddings) == (49152, 100000.0, True)
    assert resolve_model("llama-3.1-405b").num_params == 405_853_388_800


def test_names_are_case_insensitive_and_aliased():
    assert resolve_model("Llama-3-8B") == resolve_model("llama-3-8b")
    assert resolve_model("Mistral-7B-v0.1").name == "mistral-7b"


@pytest.mark.parametrize("spec", list_models(), ids=lambda s: s.name)
def test_every_preset_param_count_matches_its_shape(spec: ModelSpec):
    # A mistyped layer count or width in the preset table shows up here.
    assert count_params(spec) == pytest.approx(spec.num_params, rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_from_config_fields(tmp_path: Path, name: str):
    m = resolve_model(str(write_config(tmp_path, CONFIGS[name])))
    assert m.num_params == pytest.approx(PUBLISHED[name], rel=0.01)
    assert count_params(resolve_model(name)) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_config_file_and_folder_both_load(tmp_path: Path):
    cfg = write_config(tmp_path / "my-llama", CONFIGS["llama-3-8b"])
    by_file, by_folder = resolve_model(str(cfg)), resolve_model(str(cfg.parent))
    assert by_file == by_folder
    assert by_file.name == "my-llama"
    assert (by_file.num_kv_heads, by_file.head_dim, by_file.architecture) == (8, 128, "LlamaForCausalLM")


def test_config_without_model_type_falls_back_to_json(tmp_path: Path):
    cfg = {k: v for k, v in CONFIGS["llama-3-8b"].items() if k != "model_type"}
    cfg.update(head_dim=64, sliding_window=1024)
    m = resolve_model(str(write_config(tmp_path, cfg, "weird.json")))
    assert (m.name, m.head_dim, m.sliding_window) == ("weird", 64, 1024)


def test_qwen_switched_off_window_is_none(tmp_path: Path):
    cfg = dict(CONFIGS["llama-3-8b"], model_type="qwen2", sliding_window=32768, use_sliding_window=False)
    assert resolve_model(str(write_config(tmp_path, cfg))).sliding_window is None


def test_stories260k_loads(shared_data: Path):
    m = resolve_model(str(shared_data / "models" / "stories260K"))
    assert (m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (5, 8, 4, 8, 512)
    assert m.rope_theta == 10000.0 and m.tied_embeddings


def test_unknown_name_suggests_close_presets():
    with pytest.raises(UnknownModelError, match="llama-3-8b") as e:
        resolve_model("llama3-8b")
    assert "\n" not in str(e.value)


def test_invalid_json_raises_model_config_error(tmp_path: Path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json"):
        resolve_model(str(bad))


@pytest.mark.parametrize("missing", ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"])
def test_missing_field_raises_model_config_error(tmp_path: Path, missing: str):
    cfg = {k: v for k, v in CONFIGS["llama-3-8b"].items() if k != missing}
    path = write_config(tmp_path, cfg)
    with pytest.raises(ModelConfigError, match=missing) as e:
        resolve_model(str(path))
    assert str(path) in str(e.value)


def test_folder_without_config_raises(tmp_path: Path):
    with pytest.raises(ModelConfigError, match="config.json"):
        resolve_model(str(tmp_path))


def test_hub_id_offline_raises_unknown_model():
    # A hub id no cache holds: kvgen must refuse (never download) and say what to pass instead.
    with pytest.raises(UnknownModelError, match="config.json") as e:
        resolve_model("kvgen-test-org/no-such-model-7b")
    assert "offline" in str(e.value)


def test_hub_id_of_a_preset_points_at_the_preset():
    with pytest.raises(UnknownModelError, match="preset llama-3-8b"):
        resolve_model("kvgen-test-org/Meta-Llama-3-8B")


def test_spec_validation_and_json_round_trip():
    m = resolve_model("qwen2.5-7b")
    assert ModelSpec(**m.to_json()) == m
    assert m.gqa_group == 7
    with pytest.raises(KvgenError):
        ModelSpec(**{**m.to_json(), "num_kv_heads": 5})
