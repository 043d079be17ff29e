"""Where a q/k/v kernel stores k and v itself (write-through), in place of the KV cache's write kernel.

The decode graphs (:mod:`.graphs`) hand one to the q/k/v projection of each
layer where the scheme keeps new tokens as they are (the runtime's generated
cache_write module names the target: ``PLAIN_TARGET``, ``PAGE``,
``PLAIN_ROW_STRIDE``): the small GEMM's RoPE epilogue (:mod:`.small_gemm`)
or the RoPE kernel (:func:`.fused.qkv_rope`) then stores each k and v head
of a token at its slot, and no write kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVWrite:
    """One layer's cache pool tensors ``k`` and ``v`` in the compute dtype, contiguous ``[pages, heads_kv,
    page_size, head_dim]`` with (page, head) rows ``row_stride`` elements apart, and each token's slot, int64
    ``[T]`` (``page * page_size + token``; negative: stored nowhere). Token t's k head h goes to
    ``k[slot // page_size, h, slot % page_size]`` (v likewise), where the write kernel puts it."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    page_size: int
    row_stride: int

    def fits(self, tokens: int, heads_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this target takes ``tokens`` tokens' k and v of ``heads_kv`` heads of ``head_dim`` in
        ``dtype`` on ``device``: pools of that shape, dtype and device and the stated row stride, one int64 slot a
        token. A launch refuses a target that does not fit (it would store at wrong offsets), as the write kernel
        refuses such pools."""
        shape = (heads_kv, self.page_size, head_dim)
        return (all(t.dtype == dtype and t.is_contiguous() and t.device == device and t.dim() == 4
                    and tuple(t.shape[1:]) == shape and t.stride(1) == self.row_stride for t in (self.k, self.v))
                and self.slots.shape == (tokens,) and self.slots.dtype == torch.int64
                and self.slots.is_contiguous() and self.slots.device == device)
