"""A decode step's block tables as they stand before its page conversions, so attention can run before them.

A residual scheme (int4's KIVI) converts a residual page into a compressed
one in the step whose token pushes it out of the residual window. The step's
metadata describes the cache after that conversion: the page is the
sequence's last compressed page (block-table entry ``num_compressed - 1``
holds its compressed id, ``dst``). The conversion kernel is short but its latency (some 6 us on an
H200, nearly independent of how many pages convert) sat between the cache
write and the attention of every layer of every such step: 0.12-0.21 ms of
a 5.6 ms Llama-3-8B step at batch 32.

Read in its *pre-conversion view* -- that entry pointing at the residual
page ``src`` the page still fills, ``num_compressed`` one less -- the
attention needs nothing of the conversion, which can then run after it (or
beside the next kernels, in a CUDA graph). The residual page is intact until
the step ends: a step's released pages are parked until then
(``BlockManager.reserve_step``). The attention reads the page's tokens in
the compute dtype in that one step, as a prefill reads its own chunk; later
steps read the compressed copy.
"""

from __future__ import annotations

import torch


def pre_conversion_view(block_tables: torch.Tensor, num_compressed: torch.Tensor, src: torch.Tensor,
                        dst: torch.Tensor, out_tables: torch.Tensor | None = None,
                        out_num_compressed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tables, num_compressed)`` of a decode step before its conversions ``src -> dst`` (int32 ``[M]``;
    pairs with ``src < 0`` are padding and ignored).

    A row whose last compressed entry (``num_compressed - 1``) is some pair's ``dst`` gets that pair's ``src``
    there and one compressed page fewer; every other row is returned as it is. A decode step converts at most
    one page a sequence, its newest compressed one, so this is exact. Device ops only (no host
    synchronization; CUDA graphs capture it); written into ``out_*`` when given (a graph's static buffers),
    else into new tensors.
    """
    last = (num_compressed.long() - 1).clamp_min(0).unsqueeze(1)
    entry = block_tables.gather(1, last).squeeze(1)
    hit = ((entry.unsqueeze(1) == dst.unsqueeze(0)) & (src >= 0).unsqueeze(0)
           & (num_compressed > 0).unsqueeze(1))
    converted = hit.any(1)
    row_src = (hit.to(src.dtype) * src.unsqueeze(0)).sum(1).to(block_tables.dtype)  # one hit a converted row
    tables = block_tables.clone() if out_tables is None else out_tables.copy_(block_tables)
    tables.scatter_(1, last, torch.where(converted, row_src, entry).unsqueeze(1))
    fewer = num_compressed - converted.to(num_compressed.dtype)
    if out_num_compressed is None:
        return tables, fewer
    return tables, out_num_compressed.copy_(fewer)
