"""GGUF checkpoints in the engine: stories260K written as a GGUF file here (no download) runs as the folder does.

The test writes the vendored stories260K (safetensors + sentencepiece
tokenizer) into a float32 llama GGUF with the ``gguf`` package's writer, as
llama.cpp's converter lays it out: llama.cpp tensor names, q/k rows
permuted, the tokenizer's pieces, scores and types in the metadata. The
engine must read config, tokenizer and weights back from that file alone
and produce HF greedy (from the original folder) token for token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="the gguf package (kvgen's eval extra) is not installed")

from kvgen.engine import SamplingParams  # noqa: E402
from kvgen.engine.gguf import GGUFError, resolve  # noqa: E402
from kvgen.engine.llm import LLM  # noqa: E402
from kvgen.errors import KvgenError  # noqa: E402

from .helpers import STORIES  # noqa: E402

PROMPT = "Once upon a time, a little girl"
TOKENS = 10


def _permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout: per head, the two rotary halves interleaved (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer, model_file) -> None:
    """The sentencepiece model's pieces, scores and types (sentencepiece's type numbers are GGUF's)."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i in range(n)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def write_stories_gguf(path) -> None:
    """stories260K as an F32 llama GGUF (tied embeddings: no ``output.weight``, as llama.cpp writes it)."""
    from safetensors.torch import load_file

    cfg = json.loads((STORIES / "config.json").read_text())
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("stories260K")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, STORIES / "tokenizer.model")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    for hf_name, t in load_file(str(STORIES / "model.safetensors")).items():
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding
        stem, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(stem)
        assert name is not None, hf_name
        w = t.float().numpy()
        if stem.endswith("q_proj"):
            w = _permute_rows(w, heads)
        elif stem.endswith("k_proj"):
            w = _permute_rows(w, kv_heads)
        writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "stories260K-f32.gguf"
    write_stories_gguf(path)
    return path


@pytest.fixture(scope="module")
def hf_greedy():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(STORIES)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist(), tok


def test_gguf_file_greedy_equals_hf_folder(stories_gguf, hf_greedy):
    prompt_ids, ref, tok = hf_greedy
    llm = LLM(str(stories_gguf), kv="fp32", max_tokens=1024, max_num_seqs=2, verbose=False)
    eng = llm.engine
    assert eng.model_config.num_layers == 5 and eng.model_config.tie_word_embeddings
    # the weights went through dequantize + un-permute: compare with the folder's, tensor by tensor
    from safetensors.torch import load_file

    want = load_file(str(STORIES / "model.safetensors"))
    params = dict(eng.runner.model.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.4.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight"):
        torch.testing.assert_close(params[name], want[name], rtol=0, atol=0)
    # the tokenizer rebuilt from the GGUF's metadata encodes as the folder's does
    assert llm.get_tokenizer()(PROMPT).input_ids == prompt_ids
    params = SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == ref, (out.token_ids, ref)
    assert out.text == tok.decode(ref, skip_special_tokens=True)


def test_folder_and_gguf_file_name_the_same_checkpoint(stories_gguf, hf_greedy):
    prompt_ids, ref, _ = hf_greedy
    llm = LLM(str(stories_gguf.parent), gguf_file=stories_gguf.name, kv="fp32", max_tokens=1024, max_num_seqs=2,
              verbose=False)
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS))[0]
    assert out.outputs[0].token_ids == ref


def test_generate_cli_takes_a_gguf_path(stories_gguf, hf_greedy, capsys):
    from kvgen.cli import main

    _, ref, _ = hf_greedy
    rc = main(["generate", "--model", str(stories_gguf), "--kv", "fp32", "--prompt", PROMPT,
               "--max-tokens", str(TOKENS), "--ignore-eos", "--json"])
    assert rc in (0, None)
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == ref


def test_gguf_mistakes_are_one_line_kvgen_errors(tmp_path, monkeypatch):
    with pytest.raises(GGUFError, match="no GGUF file"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(GGUFError, match="no GGUF file"):
        LLM(str(tmp_path), gguf_file="missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(KvgenError, match="could not read the config"):
        LLM(str(tmp_path / "junk.gguf"))
    assert resolve(str(STORIES), None) is None  # a folder stays a folder
    # without the gguf package: a one-line error naming the extra, before transformers is asked
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(GGUFError, match=r"pip install 'kvgen\[eval\]'"):
        LLM(str(tmp_path / "junk.gguf"))


def test_a_quantization_gguf_cannot_dequantize_is_a_one_line_error(stories_gguf, monkeypatch):
    """gguf raises NotImplementedError for a tensor type it has no dequantizer for; kvgen says which file."""
    import gguf

    def unsupported(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype} is not yet implemented\n(traceback detail)")

    monkeypatch.setattr(gguf, "dequantize", unsupported)  # transformers imports it from the package per call
    with pytest.raises(GGUFError, match=r"could not read the tensors of .*: Dequantization for .* not yet") as e:
        LLM(str(stories_gguf), kv="fp32", max_tokens=256, verbose=False)
    assert "\n" not in str(e.value)


def test_a_rank_loads_its_slices_of_the_gguf(stories_gguf):
    """A tensor-parallel rank's share read from the GGUF is its slice of the whole model read from the folder."""
    from kvgen.engine.config import ModelConfig
    from kvgen.engine.shard import TPShard
    from kvgen.engine.weights import build_model, load_weights
    from kvgen.integrations.tensor_parallel import head_shard

    cfg = ModelConfig.from_folder(STORIES)

    def loaded(source, shard=None):
        return load_weights(build_model(cfg, 64, torch.device("cpu"), torch.float32, shard), source)

    whole = dict(loaded(STORIES).named_parameters())
    for rank in range(8):  # replicated KV heads (4 for 8 ranks) and an uneven MLP split (172 / 8)
        shard = TPShard.of(cfg, rank, 8, *head_shard(cfg.num_heads, cfg.num_kv_heads, rank, 8))
        for name, p in loaded(stories_gguf, shard).named_parameters():
            split = shard.split_of(name, cfg)
            want = whole[name] if split is None else whole[name].narrow(split[0], split[1], split[2] - split[1])
            assert torch.equal(p, want), (rank, name)
