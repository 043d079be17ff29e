"""ModelSpec: the facts about a model that the planner needs, and how to obtain one.

``resolve_model`` accepts, in this order:

1. a preset name (case-insensitive, aliases allowed; plugins may add presets);
2. a path to a ``config.json`` or to a folder holding one;
3. a hub id (``org/name``) whose config is already in the local Hugging Face
   cache -- kvgen never downloads;

and raises ``UnknownModelError`` / ``ModelConfigError`` (one-line messages)
for everything else.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgen import model_presets
from kvgen.errors import ModelConfigError, UnknownModelError


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer, as far as KV-cache planning is concerned.

    ``head_dim`` is the per-head width of K and V (not always hidden/heads:
    gemma-2 uses 256). ``sliding_window`` is None for full attention; when
    set it may apply to only some layers (gemma-2 alternates). ``num_params``
    counts every parameter once (tied embeddings once).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rope_theta: float
    sliding_window: int | None
    tied_embeddings: bool
    num_params: int
    architecture: str
    num_experts: int = 1
    num_experts_per_tok: int = 1

    def __post_init__(self) -> None:
        # Checked here so that no stage downstream divides by zero or shards heads unevenly.
        for f in ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "max_positions", "num_experts", "num_experts_per_tok"):
            if getattr(self, f) < 1:
                raise ModelConfigError(f"model {self.name}: {f} is {getattr(self, f)}, must be >= 1; fix the config")
        if self.num_q_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"model {self.name}: {self.num_q_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} KV heads; fix num_key_value_heads in the config")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelConfigError(
                f"model {self.name}: {self.num_experts_per_tok} experts per token exceeds "
                f"{self.num_experts} experts; fix num_experts_per_tok in the config")
        # A NaN/Inf theta would be written into plan.json and rotate every position to garbage.
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ModelConfigError(
                f"model {self.name}: rope_theta is {self.rope_theta!r}, must be a finite number > 0; fix the config")
        # A window of 0 or fewer tokens would mask every key (decode returns zeros); None means full attention.
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelConfigError(
                f"model {self.name}: sliding_window is {self.sliding_window}, must be a positive number of tokens "
                "or null (no window); fix the config")
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ModelConfigError(
                f"model {self.name}: architecture is {self.architecture!r}, must be a class name such as "
                "LlamaForCausalLM; fix the config's architectures")

    @property
    def gqa_group(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_q_heads // self.num_kv_heads

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict; ``ModelSpec(**spec.to_json())`` round-trips."""
        return dataclasses.asdict(self)


def count_params(spec: ModelSpec, *, qkv_bias: bool = False, norms_per_layer: int = 2) -> int:
    """Parameter count of a Llama-style decoder with ``spec``'s shapes.

    Counts embeddings, q/k/v/o projections (k/v sized by KV heads), a gated
    MLP (gate/up/down) per expert plus a router when there are experts,
    ``norms_per_layer`` RMSNorm weights per layer and a final norm, and an
    lm_head unless embeddings are tied. ``qkv_bias`` adds Qwen2-style q/k/v
    biases; gemma-2 has 4 norms per layer. Other architectures (biases
    everywhere, learned positions) come out approximately, which is all the
    planner needs: the count only sizes the weights sharing the GPU.
    """
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_q_heads * d, spec.num_kv_heads * d
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if qkv_bias else 0)
    mlp = spec.num_experts * 3 * h * spec.intermediate_size
    router = h * spec.num_experts if spec.num_experts > 1 else 0
    per_layer = attn + mlp + router + norms_per_layer * h
    embed = spec.vocab_size * h
    lm_head = 0 if spec.tied_embeddings else spec.vocab_size * h
    return spec.num_layers * per_layer + embed + h + lm_head


# ---------------------------------------------------------------- lookup


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _presets() -> dict[str, ModelSpec]:
    cols = model_presets.COLUMNS
    return {row[0]: ModelSpec(**dict(zip(cols, row))) for row in model_presets.PRESETS}


def _plugin_models() -> list[ModelSpec]:
    # Imported here: loading plugins is only worth it when a name is not a built-in.
    from kvgen.registry import default_registry

    objs = default_registry().models.values()
    return [o[0] if isinstance(o, tuple) else o for o in objs]


def list_models() -> list[ModelSpec]:
    """Built-in presets, then plugin-registered models whose names are not taken."""
    specs = list(_presets().values())
    taken = {_norm(s.name) for s in specs}
    return specs + [m for m in _plugin_models() if _norm(m.name) not in taken]


def _closest(name: str, n: int = 3, cutoff: float = 0.0) -> list[str]:
    specs = list_models()
    canon = {_norm(s.name): s.name for s in specs}
    canon.update({a: t for a, t in model_presets.ALIASES.items()})
    out: list[str] = []
    for hit in difflib.get_close_matches(_norm(name), list(canon), n=len(canon), cutoff=cutoff):
        if canon[hit] not in out:
            out.append(canon[hit])
    return out[:n]


def _lookup_preset(name: str) -> ModelSpec | None:
    key = _norm(name)
    key = model_presets.ALIASES.get(key, key)
    presets = _presets()
    if key in presets:
        return presets[key]
    return next((m for m in _plugin_models() if _norm(m.name) == key), None)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a preset name, a config.json / model folder, or a locally cached hub id.

    Raises ``UnknownModelError`` when nothing matches (with the 3 closest
    preset names, or for a hub id that is not cached, how to pass a local
    config instead) and ``ModelConfigError`` for an unreadable or incomplete
    config. Never touches the network.
    """
    spec = _lookup_preset(name_or_path)
    if spec is not None:
        return spec
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelConfigError(f"folder {path} has no config.json; pass a model folder that holds one, or the config file itself")
        return _from_config_file(cfg, name=path.resolve().name)
    if path.is_file():
        return _from_config_file(path, name=path.resolve().parent.name if path.name == "config.json" else path.stem)
    if _HUB_ID.match(name_or_path.strip()) and not name_or_path.strip().endswith(".json"):
        return _from_hub_cache(name_or_path.strip())
    if name_or_path.strip().endswith(".json") or name_or_path.strip().startswith(("/", ".", "~")):
        raise UnknownModelError(f"no file or folder at {name_or_path}; pass an existing config.json or model folder, or a preset name (kvgen models lists them)")
    raise UnknownModelError(
        f"unknown model {name_or_path!r}; closest presets: {', '.join(_closest(name_or_path))} "
        "(kvgen models lists all; a config.json path or model folder also works)")


# ---------------------------------------------------------------- configs


def _silent_autoconfig(source: str):
    """AutoConfig from a local file, folder or cached hub id, or None when transformers cannot."""
    try:
        import transformers
        from transformers import AutoConfig
    except Exception:  # transformers missing or broken: the JSON reader still works
        return None
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its warnings would drown our one-line errors
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception:  # unknown model_type, remote code, not cached...: caller falls back or reports
        return None
    finally:
        transformers.logging.set_verbosity(level)


MAX_CONFIG_BYTES = 16 * 2**20
"""A config.json is a few KB; anything this large is not one (and is not read into memory)."""


def _from_config_file(path: Path, name: str) -> ModelSpec:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB, too large for a config.json; "
                                   "pass a Hugging Face config.json")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelConfigError(f"cannot read {path}: {e.strerror or e}; check the path and its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON ({e}); pass a Hugging Face config.json") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ModelConfigError(f"{path} nests JSON too deeply to be a config; pass a Hugging Face config.json") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object; pass a Hugging Face config.json")
    return spec_from_config(raw, name=name, source=str(path), hf=_silent_autoconfig(str(path)))


def _from_hub_cache(hub_id: str) -> ModelSpec:
    hf = _silent_autoconfig(hub_id)
    if hf is None:
        close = _closest(hub_id.split("/")[-1], n=1, cutoff=0.75)
        hint = f", or use the preset {close[0]}" if close else ""
        raise UnknownModelError(
            f"{hub_id} is not in the local Hugging Face cache and kvgen cannot fetch it offline; "
            f"download it and pass its local config.json or model folder{hint}")
    return spec_from_config(hf.to_dict(), name=hub_id, source=hub_id, hf=hf)


# spec field -> config keys accepted, the Hugging Face name first (named in errors).
_REQUIRED = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_q_heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "d_ff", "n_inner"),
    "vocab_size": ("vocab_size",),
    "max_positions": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
}
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}  # their attention hard-codes q/k/v biases
_FOUR_NORM_TYPES = {"gemma2", "gemma3", "gemma3_text"}  # pre/post norms around attention and MLP


def spec_from_config(raw: dict[str, Any], *, name: str, source: str, hf: Any = None) -> ModelSpec:
    """A ModelSpec from a config dict (``raw``, as written in the file) and, optionally, its AutoConfig.

    Values written in ``raw`` win; ``hf`` supplies transformers' per-model
    defaults for keys the file leaves out. The fields in ``_REQUIRED`` must
    be written in the file (a default layer count would be a silent lie):
    a missing one raises ModelConfigError naming ``source`` and the key.
    """
    if "text_config" in raw and isinstance(raw["text_config"], dict) and "num_hidden_layers" not in raw:
        raw = {**raw, **raw["text_config"]}  # multimodal wrappers keep the decoder under text_config
    if hf is not None and hasattr(hf, "get_text_config"):
        hf = hf.get_text_config()

    def get(keys: tuple[str, ...], default: Any = None) -> Any:
        for k in keys:
            if raw.get(k) is not None:
                return raw[k]
        for k in keys:
            if hf is not None and getattr(hf, k, None) is not None:
                return getattr(hf, k)
        return default

    def as_int(key: str, v: Any) -> int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ModelConfigError(f"{source}: {key} must be an integer, got {v!r}; fix the config")
        return v

    f: dict[str, Any] = {}
    for field, keys in _REQUIRED.items():
        if all(raw.get(k) is None for k in keys):
            raise ModelConfigError(f"{source} lacks {keys[0]}; kvgen needs it to size the KV cache, add it to the config")
        f[field] = as_int(keys[0], get(keys))
        if f[field] < 1:  # checked before head_dim divides by the head count
            raise ModelConfigError(f"{source}: {keys[0]} is {f[field]}, must be >= 1; fix the config")
    f["num_kv_heads"] = as_int("num_key_value_heads", get(("num_key_value_heads", "num_kv_heads", "n_head_kv"), f["num_q_heads"]))
    f["head_dim"] = as_int("head_dim", get(("head_dim",), f["hidden_size"] // f["num_q_heads"]))
    f["num_experts"] = as_int("num_local_experts", get(("num_local_experts", "num_experts", "n_routed_experts"), 1))
    f["num_experts_per_tok"] = as_int("num_experts_per_tok", get(("num_experts_per_tok", "moe_topk"), 1) if f["num_experts"] > 1 else 1)
    theta = None
    try:
        theta = _rope_theta(raw, hf)
        if isinstance(theta, bool):
            raise TypeError
        f["rope_theta"] = float(theta)
    except (TypeError, ValueError, OverflowError):
        raise ModelConfigError(f"{source}: rope_theta must be a number, got {theta!r}; fix the config") from None
    if not (math.isfinite(f["rope_theta"]) and f["rope_theta"] > 0):
        raise ModelConfigError(f"{source}: rope_theta is {f['rope_theta']}, must be a finite number > 0; fix the config")
    window = get(("sliding_window",))
    if raw.get("use_sliding_window") is False:
        window = None  # Qwen2 writes a window but switches it off
    f["sliding_window"] = None if window is None else as_int("sliding_window", window)
    if f["sliding_window"] is not None and f["sliding_window"] < 1:
        raise ModelConfigError(f"{source}: sliding_window is {f['sliding_window']}, must be a positive number of "
                               "tokens or null (no window); fix the config")
    f["tied_embeddings"] = bool(get(("tie_word_embeddings",), True))  # True is the transformers base default
    model_type = get(("model_type",), "")
    if not isinstance(model_type, str):
        raise ModelConfigError(f"{source}: model_type must be a string, got {model_type!r}; fix the config")
    archs = get(("architectures",))
    # A string here would be indexed character by character ("L"): only a list of class names is valid.
    if archs is not None and not (isinstance(archs, (list, tuple)) and all(isinstance(a, str) and a for a in archs)):
        raise ModelConfigError(f"{source}: architectures must be a list of class names such as "
                               f'["LlamaForCausalLM"], got {archs!r}; fix the config')
    archs = archs or [_causal_lm_class(model_type)]
    spec = ModelSpec(name=name, architecture=archs[0], num_params=0, **f)
    params = count_params(spec, qkv_bias=bool(raw.get("attention_bias", model_type in _QKV_BIAS_TYPES)),
                          norms_per_layer=4 if model_type in _FOUR_NORM_TYPES else 2)
    return dataclasses.replace(spec, num_params=params)


def _causal_lm_class(model_type: str) -> str:
    """The transformers class name for a model_type, for configs that omit ``architectures``."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except Exception:  # an older or trimmed transformers: the model_type still identifies it
        return model_type or "unknown"
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type or "unknown")


def _rope_theta(raw: dict[str, Any], hf: Any) -> float:
    """rope_theta wherever this transformers version keeps it (top level, or rope_parameters in v5)."""
    for src in (raw, getattr(hf, "__dict__", {})):
        if src.get("rope_theta") is not None:
            return src["rope_theta"]
        params = src.get("rope_parameters") or src.get("rope_scaling")
        if isinstance(params, dict):
            if params.get("rope_theta") is not None:
                return params["rope_theta"]
            # per layer type (gemma-3 style): full attention is the one the KV cache keeps longest
            nested = params.get("full_attention") or next((v for v in params.values() if isinstance(v, dict)), None)
            if isinstance(nested, dict) and nested.get("rope_theta") is not None:
                return nested["rope_theta"]
    return 10000.0  # the Llama default, used by configs that predate the key
