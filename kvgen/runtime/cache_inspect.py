"""Reading a sequence's cached K/V back as float32 (a mixin of :class:`~.cache.KVCache`): tests and debugging.

Host-synchronizing, and slow by design: it waits for the host tier's copies,
gathers pages on the host into a private pool, and dequantizes compressed
pages with the plan's ``dequant`` kernel.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .errors import KvgenRuntimeError


class InspectionMixin:
    """KVCache's inspection method (it provides block_manager, kernels, host_tier, page_size, device...)."""

    def read_kv(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K and V of one sequence as float32 ``[H, seq_len, D]`` (dequantized)."""
        pools = self._layer(layer)
        bm = self.block_manager
        if self.host_tier is not None:
            self.wait_host_tier()  # copies in flight may still write the pages read below
        n, table, nc = bm.seq_len(seq_id), bm.block_table(seq_id), bm.num_compressed(seq_id)
        P, H, D = self.page_size, self.num_kv_heads, self.head_dim
        if bm.host_pages(seq_id):  # pages on the host: read every page into a private pool, in order
            pools = self._gather_pages(layer, seq_id, table, nc)
            table = list(range(nc)) + list(range(len(table) - nc))
        ks, vs = [], []
        if nc:
            if "dequant" not in self.kernels:
                raise KvgenRuntimeError("the kernels lack the dequant op; recompile the plan")
            pages = torch.tensor(table[:nc], dtype=torch.int32, device=self.device)
            k_out = torch.empty(nc, H, P, D, dtype=self.dtype, device=self.device)
            v_out = torch.empty_like(k_out)
            self.kernels["dequant"].launch(pools, pages, k_out, v_out)
            ks.append(k_out)
            vs.append(v_out)
        if len(table) > nc:
            idx = torch.tensor(table[nc:], dtype=torch.long, device=self.device)
            ks.append(pools["rk"].index_select(0, idx))
            vs.append(pools["rv"].index_select(0, idx))
        if not ks:
            empty = torch.empty(H, 0, D, dtype=torch.float32, device=self.device)
            return empty, empty.clone()
        k = torch.cat(ks).permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
        v = torch.cat(vs).permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
        return k.float(), v.float()
