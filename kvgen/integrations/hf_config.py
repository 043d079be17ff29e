"""The two facts about a Hugging Face config that kvgen reads in several places.

Multimodal configs nest the language model's config (``get_text_config``);
older ones have no ``head_dim`` and imply ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The decoder (language model) part of ``config``; ``config`` itself for plain LMs."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def head_dim(config: Any) -> int:
    """Per-head dimension of the decoder's attention."""
    text = text_config(config)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
