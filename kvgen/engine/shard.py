"""One tensor-parallel rank's share of a Llama-family model (Megatron style; no torch).

Column-parallel (output rows split): q by query heads, k and v by KV heads
(the heads the rank's KVCache holds: ``kv_head_range()``, replicated when
the ranks outnumber the KV heads), gate and up by intermediate channels.
Row-parallel (input columns split): o by query heads, down by intermediate
channels; their partial outputs are summed over the ranks (one all-reduce
each per layer) before the bias. Embeddings, norms and the LM head are
replicated.

Intermediate channels are split as evenly as possible (rank r holds
``[r*I//N, (r+1)*I//N)``): the row-parallel sum is exact for any split, so
N need not divide I. Head counts must divide; the planner checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ModelConfig

# checkpoint name suffix -> (which split, tensor dim cut): "q" query heads, "kv" KV heads, "mlp" channels
_SPLITS = {
    "self_attn.q_proj.weight": ("q", 0), "self_attn.q_proj.bias": ("q", 0),
    "self_attn.k_proj.weight": ("kv", 0), "self_attn.k_proj.bias": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0), "self_attn.v_proj.bias": ("kv", 0),
    "self_attn.o_proj.weight": ("q", 1),
    "mlp.gate_proj.weight": ("mlp", 0), "mlp.gate_proj.bias": ("mlp", 0),
    "mlp.up_proj.weight": ("mlp", 0), "mlp.up_proj.bias": ("mlp", 0),
    "mlp.down_proj.weight": ("mlp", 1),
}


def channel_range(total: int, rank: int, size: int) -> range:
    """Rank ``rank``'s share of ``total`` channels split over ``size`` ranks as evenly as possible."""
    return range(rank * total // size, (rank + 1) * total // size)


@dataclass
class TPShard:
    """What rank ``rank`` of ``size`` holds: ``q_heads``, ``kv_heads`` (model head indices), ``inter`` channels.

    ``group``: the torch.distributed group of the row-parallel all-reduces
    (None: the default group); set in the rank's own process.
    """

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inter: range
    group: Any = None

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, q_heads: range, kv_heads: range) -> "TPShard":
        """The shard of a rank whose KVCache holds ``kv_heads`` and computes ``q_heads``."""
        return cls(rank, size, q_heads, kv_heads, channel_range(cfg.intermediate_size, rank, size))

    def split_of(self, name: str, cfg: ModelConfig) -> tuple[int, int, int, int] | None:
        """``(dim, start, stop, full)`` of checkpoint tensor ``name`` held by this rank; None when replicated.

        ``full`` is the whole model's size along ``dim``: the rank keeps
        ``tensor.narrow(dim, start, stop - start)``.
        """
        split = next((v for k, v in _SPLITS.items() if name.endswith(k)), None)
        if split is None:
            return None
        kind, dim = split
        D = cfg.head_dim
        if kind == "q":
            return dim, self.q_heads.start * D, self.q_heads.stop * D, cfg.q_size
        if kind == "kv":
            return dim, self.kv_heads.start * D, self.kv_heads.stop * D, cfg.kv_size
        return dim, self.inter.start, self.inter.stop, cfg.intermediate_size
