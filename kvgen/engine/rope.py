"""Rotary position embedding (rotate-half form, as Hugging Face Llama), with linear and llama3 scaling."""

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
    """cos/sin tables for positions ``[0, max_positions)`` in the model dtype; ``apply`` rotates q and k in place-free form."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        inv = inv_frequencies(cfg)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` of ``positions [T]`` (int64): once per step, for every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]`` -> rotated q, k (cos/sin from :meth:`lookup`)."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``positions [T]`` int64 -> rotated q, k."""
        return self.rotate(q, k, *self.lookup(positions))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
