"""Fit nuq4 key codebooks on a real model's keys (``kvgen nuq calibrate``).

The model runs over the calibration text in windows; its keys are read per
layer and, for each page size, cut into pages per KV head and normalized
exactly as the scheme normalizes them (per-token outliers out, per-channel
mid/half range over the page, see :mod:`kvgen_nuq.codebook`); a 16-level
codebook is fitted by 1-D k-means per (page size, layer) and per page size
on all layers pooled (equal weight per layer).

Which keys: ``post-rope`` (default) reads them from the model's KV cache
after the forward pass, i.e. exactly what kvgen's cache stores and nuq4's
kernels quantize (RoPE mixes channel pairs by position, which is why
KVQuant quantizes pre-RoPE; kvgen's cache holds post-RoPE keys, so that is
the distribution to fit). ``pre-rope`` hooks every ``k_proj`` output
instead, for experiments with a pre-RoPE cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgen.plugin_api import KvgenError
from kvgen_nuq.codebook import (LEVELS, fit_codebook, normalized_inliers, outliers_per_token, rms_error,
                                save_codebooks)

PAGE_SIZES = (8, 16, 32, 64, 128)
"""Page sizes a codebook is fitted for by default (every page size kvgen plans)."""
UNIFORM = torch.linspace(-1.0, 1.0, LEVELS)
"""16 evenly spaced levels over [-1, 1]: what uniform 4-bit codes of the same normalization give."""


class CalibrationError(KvgenError):
    """Calibration input that cannot be used (missing model or text, too little text)."""


@dataclass
class Collected:
    """Per page size and layer, (normalized inlier key values, weights) per window; raw samples."""

    values: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]]
    keys: list[list[torch.Tensor]]      # per layer, per kept window: [H, T, D] float32
    vals: list[list[torch.Tensor]]
    tokens: int
    windows: int
    head_dim: int
    num_kv_heads: int


def load_model(model_path: str, gguf_file: str | None = None):
    """(model, tokenizer) from a local Hugging Face folder (float32, eval mode, CPU)."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise CalibrationError(f"no model folder at {model_path}; pass --model-path DIR with a Hugging Face model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    except TypeError:  # older transformers: torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32, **kw)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot load a model from {model_path}: {exc}") from None
    model.eval()
    return model, tok


def token_windows(tok, text: str, window: int, max_tokens: int, min_tokens: int) -> list[torch.Tensor]:
    """Token id windows: documents split on ``<|endoftext|>``, each tokenized and cut into ``window`` tokens."""
    docs = [d.strip() for d in text.split("<|endoftext|>")] if "<|endoftext|>" in text else [text]
    out, total = [], 0
    for doc in docs:
        if not doc:
            continue
        ids = tok(doc, return_tensors="pt")["input_ids"][0]
        for i in range(0, ids.numel(), window):
            w = ids[i:i + window][: max_tokens - total]
            if w.numel() < min_tokens:
                continue
            out.append(w)
            total += w.numel()
            if total >= max_tokens:
                return out
    return out


def _cache_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``[B, H, T, D]`` of one layer from a transformers cache, across versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]


def _k_proj_modules(model) -> list[torch.nn.Module]:
    mods = [m for n, m in model.named_modules() if n.endswith("k_proj")]
    if not mods:
        raise CalibrationError("pre-rope calibration needs k_proj modules in the model; use --keys post-rope")
    return mods


def collect(model, windows: list[torch.Tensor], page_sizes: tuple[int, ...], keys: str = "post-rope",
            keep_samples: int = 0, max_values: int = 16_000_000, seed: int = 0) -> Collected:
    """Run the model over ``windows`` and gather normalized key values per page size and layer.

    At most about ``max_values`` values are kept in all (memory: 8 bytes
    each), split evenly over (page size, layer) pairs and windows: each
    window contributes a seeded random subset of its share (for a 30-layer
    model and 5 page sizes, ~100K values per codebook, plenty for 16 levels).
    """
    cfg = model.config
    num_layers = cfg.num_hidden_layers
    num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    values = {p: [[] for _ in range(num_layers)] for p in page_sizes}
    ks: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    vs: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
    share = -(-max_values // max(1, len(windows) * len(page_sizes) * num_layers))
    gen = torch.Generator().manual_seed(seed)
    captured: list[torch.Tensor] = []
    hooks = []
    if keys == "pre-rope":
        for m in _k_proj_modules(model):
            hooks.append(m.register_forward_hook(lambda _m, _i, out: captured.append(out.detach())))
    tokens = 0
    try:
        with torch.no_grad():
            for w, ids in enumerate(windows):
                captured.clear()
                out = model(ids[None], use_cache=True)
                # transformers 5 names the output cache ``cache`` (``past_key_values`` is deprecated there)
                cache = out["cache"] if "cache" in out else out.past_key_values
                for layer in range(num_layers):
                    k, v = _cache_kv(cache, layer)
                    if keys == "pre-rope":
                        t = captured[layer]
                        k = t.reshape(t.shape[0], t.shape[1], num_kv, head_dim).transpose(1, 2)
                    k, v = k[0].float(), v[0].float()                     # [H, T, D]
                    for p in page_sizes:
                        x, wt = normalized_inliers(k, p)
                        if x.numel() > share:
                            pick = torch.randperm(x.numel(), generator=gen)[:share]
                            x, wt = x[pick], wt[pick]
                        values[p][layer].append((x, wt))
                    if w < keep_samples:
                        ks[layer].append(k.clone())
                        vs[layer].append(v.clone())
                tokens += ids.numel()
    finally:
        for h in hooks:
            h.remove()
    return Collected(values=values, keys=ks, vals=vs, tokens=tokens, windows=len(windows),
                     head_dim=head_dim, num_kv_heads=num_kv)


def fit(per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]], max_samples: int = 2_000_000,
        seed: int = 0) -> dict[str, Any]:
    """``{"pooled", "layers", "stats"}`` for one page size from per-layer lists of (values, weights).

    The pooled codebook is fitted on an equal share of every layer's values
    (weights normalized per layer, so no layer dominates by its key scale).
    Stats are weighted rms errors in normalized units (see :func:`normalized_inliers`).
    """
    layers, stats, px, pw = [], [], [], []
    share = max(LEVELS, max_samples // max(1, len(per_layer)))
    gen = torch.Generator().manual_seed(seed)
    flat = [(torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) if v else (torch.zeros(0), torch.zeros(0))
            for v in per_layer]
    for i, (x, w) in enumerate(flat):
        cb, _ = fit_codebook(x, w, max_samples=max_samples, seed=seed + i)
        layers.append(cb)
        pick = torch.randperm(x.numel(), generator=gen)[:share]
        px.append(x[pick])
        pw.append(w[pick] / w[pick].mean().clamp(min=1e-30))
    pooled, _ = fit_codebook(torch.cat(px), torch.cat(pw), max_samples=max_samples, seed=seed)
    for i, (x, w) in enumerate(flat):
        stats.append({"layer": i, "values": int(x.numel()),
                      "rms_layer": round(rms_error(x, layers[i], w), 6),
                      "rms_pooled": round(rms_error(x, pooled, w), 6),
                      "rms_uniform": round(rms_error(x, UNIFORM, w), 6)})
    return {"pooled": pooled, "layers": layers, "stats": stats}


def calibrate(model_path: str, text_path: str, out_path: str, *, page_sizes: tuple[int, ...] = PAGE_SIZES,
              window: int | None = None, max_tokens: int = 65536, keys: str = "post-rope",
              gguf_file: str | None = None) -> dict[str, Any]:
    """The whole of ``kvgen nuq calibrate``: fit, write ``out_path``, return a summary."""
    text_file = Path(text_path).expanduser()
    if not text_file.is_file():
        raise CalibrationError(f"no text file at {text_path}; pass --text FILE with plain calibration text")
    if keys not in ("post-rope", "pre-rope"):
        raise CalibrationError(f"--keys must be post-rope or pre-rope, got {keys!r}")
    page_sizes = tuple(sorted(set(page_sizes)))
    if not page_sizes or min(page_sizes) < 2:
        raise CalibrationError(f"--page-sizes must be page sizes of at least 2 tokens, got {page_sizes}")
    model, tok = load_model(model_path, gguf_file)
    max_pos = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    window = min(window or 1024, max_pos)
    if window < max(page_sizes):
        raise CalibrationError(f"--window {window} is shorter than a page ({max(page_sizes)} tokens); "
                               "raise --window or drop the large page sizes")
    windows = token_windows(tok, text_file.read_text(encoding="utf-8", errors="replace"), window, max_tokens,
                            max(page_sizes))
    if not windows:
        raise CalibrationError(f"{text_path} gave no window of at least {max(page_sizes)} tokens; give more text")
    collected = collect(model, windows, page_sizes, keys)
    fits = {p: fit(collected.values[p]) for p in page_sizes}
    name = Path(model_path).expanduser().resolve().name if not gguf_file else Path(gguf_file).stem
    meta = {
        "model": name,
        "text": text_file.name,
        "tokens": collected.tokens,
        "windows": collected.windows,
        "window": window,
        "keys": keys,
        "head_dim": collected.head_dim,
        "num_kv_heads": collected.num_kv_heads,
        "outliers_per_token": outliers_per_token(collected.head_dim),
    }
    save_codebooks(out_path, fits, meta)
    return {**meta, "out": str(out_path),
            "codebooks": {p: {"pooled": [round(float(c), 5) for c in f["pooled"]], "stats": f["stats"]}
                          for p, f in fits.items()}}
