"""The ``"kvgen"`` attention and mask functions that transformers calls in each attention layer.

:func:`register` (idempotent) adds both to transformers' ``AttentionInterface``
and ``AttentionMaskInterface`` under :data:`~.hf_cache.ATTN_NAME`.
:func:`kvgen_attention` takes the K/V a :class:`~.hf_cache.KvgenCache` parked
in its ``update`` and runs the paged kvgen kernels through
:meth:`~.hf_cache.KvgenCache.attend`; a forward without a KvgenCache
(``use_cache=False``, another cache type) falls back to PyTorch SDPA with a
causal and padding mask. :func:`kvgen_mask` hands the 2-D padding mask
through unchanged, so the attention knows which tokens are padding.
``output_attentions`` is refused with :class:`~.hf_cache.KvgenIntegrationError`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvgen.integrations.hf_cache import ATTN_NAME, KvgenIntegrationError, _take_pending

_registered = False


def _fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """PyTorch SDPA with a causal (+ padding) mask: for forwards without a KvgenCache.

    Key ``j`` is position ``j``; the 2-D mask (if any) covers the first
    ``L`` keys (a static cache may return more, unwritten ones: masked).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if (mask is not None and mask.dim() == 2) or (mask is None and q_len > 1 and kv_len > q_len):
        L = mask.shape[-1] if mask is not None else kv_len
        i = torch.arange(q_len, device=query.device)[:, None] + (L - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        visible = (j <= i) & (j < L)
        if mask is not None:
            pad = torch.zeros(mask.shape[0], kv_len, dtype=torch.bool, device=query.device)
            width = min(L, kv_len)
            pad[:, :width] = mask[:, :width].to(device=query.device, dtype=torch.bool)
            visible = (visible[None] & pad[:, None, :]) | (j == i)[None]  # a padding query sees itself: no NaN
            mask = visible[:, None]
        else:
            mask = visible[None, None]
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def kvgen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"kvgen"`` AttentionInterface function: paged kvgen kernels when the cache is a KvgenCache."""
    cache = _take_pending(module, key)
    if cache is None:
        return _fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if kwargs.get("output_attentions"):
        raise KvgenIntegrationError("output_attentions is not supported by the kvgen attention")
    out = cache.attend(module.layer_idx, query, key, value, attention_mask, scaling)
    return out, None


def kvgen_mask(batch_size: int = 0, q_length: int = 0, kv_length: int = 0, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The ``"kvgen"`` mask function: the 2-D padding mask, unchanged (the kernels are causal by position)."""
    return attention_mask


def register() -> None:
    """Register the ``"kvgen"`` attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kvgen_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvgen_mask)
    _registered = True
