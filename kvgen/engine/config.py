"""ModelConfig: what the executor needs from a Hugging Face config.json, read without transformers.

Supported: decoder-only Llama-family models -- ``llama`` (Llama 2/3/3.1/3.2,
SmolLM2), ``mistral``, ``qwen2`` (Qwen2/2.5: q/k/v biases), ``qwen3``
(per-head RMSNorm on q and k). RoPE: default, ``linear`` and ``llama3``
scaling. Anything else raises :class:`EngineError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineError

ENGINE_BACKENDS = ("triton", "cuda", "auto")
"""The kernel languages the engine runs (``kernel_backend``, ``--backend``): ``triton``, ``cuda`` (the CUDA decode
kernel where the scheme has one), or ``auto``: the package holds both, and at start the engine asks the runtime to
decide the decode kernel by timing them (``cache.choose_backend``), once per GPU and kernel, persisted beside the
tuned configs (later starts reuse it), before any CUDA graph is captured. ``auto`` means ``triton`` on a non-CUDA
device and on ROCm (nothing is built with nvcc); where the CUDA kernel cannot be built (no nvcc, no build of it in
the build cache) the runtime skips it with a warning and runs Triton; with autotuning off, a remembered choice or
Triton runs."""
DEFAULT_ENGINE_BACKEND = "auto"
"""``kernel_backend``'s default (``LLM``, ``build_engine``, ``kvgen generate``/``serve --backend``)."""

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one Llama-family decoder (whole model, before any tensor-parallel split)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if "text_config" in raw and isinstance(raw["text_config"], dict) and "num_hidden_layers" not in raw:
            raw = {**raw, **raw["text_config"]}
        mt = raw.get("model_type")
        if mt not in SUPPORTED_TYPES:
            raise EngineError(f"{source}: model_type {mt!r} is not supported by the kvgen engine; "
                              f"supported: {', '.join(SUPPORTED_TYPES)}")

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise EngineError(f"{source} lacks {key}; the engine needs it, add it to the config")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise EngineError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        window = raw.get("sliding_window")
        if raw.get("use_sliding_window") is False or mt in ("llama", "qwen3") and not raw.get("use_sliding_window"):
            window = None
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=mt, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=int(need("num_hidden_layers")),
            num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bias or mt == "qwen2", o_bias=bias and mt != "qwen2", mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=mt == "qwen3", rope_scaling=rope, sliding_window=None if window is None else int(window),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"))

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        cfg = Path(path) / "config.json"
        try:
            raw = json.loads(cfg.read_text(encoding="utf-8"))
        except OSError as e:
            raise EngineError(f"cannot read {cfg}: {e.strerror or e}; pass a Hugging Face model folder") from None
        except json.JSONDecodeError as e:
            raise EngineError(f"{cfg} is not valid JSON ({e}); pass a Hugging Face config.json") from None
        return cls.from_dict(raw, str(cfg))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
