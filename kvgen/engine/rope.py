"""Rotary position embedding tables (rotate-half form, as Hugging Face Llama), with linear and llama3 scaling.

The rotation itself runs in :func:`kvgen.engine.fused.qkv_rope` (one kernel for q, k and v).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies after the config's RoPE scaling."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class Rotary:
    """float32 cos/sin tables ``[max_positions, head_dim // 2]``, built once at load.

    Rotate-half form (as Hugging Face Llama): with ``x = [x1 | x2]``,
    ``rotate(x) = [x1 cos - x2 sin | x2 cos + x1 sin]``. The halves are not
    duplicated (HF's ``cat((freqs, freqs))``): the fused kernel reads
    ``cos[pos]``/``sin[pos]`` once for both halves. float32 whatever the
    model dtype: the kernel rotates in float32 and rounds once.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv = inv_frequencies(cfg)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        self.cos = freqs.cos().to(device).contiguous()
        self.sin = freqs.sin().to(device).contiguous()
