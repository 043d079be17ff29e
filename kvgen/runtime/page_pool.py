"""The device page pools of a plan: :class:`PagePool` (one layer's pages per pool, the staging ring), their sizes.

:func:`pool_sizes` turns a plan (and an optional token budget) into page
counts; :class:`PagePool` allocates the plan's page tensors for every layer,
with the host tier's staging ring placed right after the last layer's
compressed pages so one ``attention_view`` per layer sees both; and
:func:`default_device` picks where a cache lives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .block_manager import COMPRESSED, RESIDUAL
from .env import triton_interpret
from .errors import KvgenRuntimeError
from .pools import allocate_pool, pool_bytes

MIN_RESIDUAL_SEQS = 4
"""With ``max_tokens``, the residual pool keeps room for at least this many sequences."""

APPEND_SLACK_PAGES = 64
"""With ``max_tokens``, residual pages beyond the sequences' tails (at most a sixteenth of the pool).

A residual scheme's long append (a prompt chunk) passes its full pages through
the residual pool on their way to compression, and each time the pool runs out
of free pages the step opens another phase (BlockManager.reserve_step): one
more cache-write and page-quantize launch per layer. With room for one
sequence's tail only (an engine with ``max_num_seqs=1``), an 8,192-token chunk
at page 16 took 512 phases, 1,024 launches a layer (some 65,000 for a 16K-token
prompt's two chunks over 32 layers); 64 spare pages make it 8. (H200, Llama-3-8B shape, 2026-12-04: such an
engine's first token of a 16K prompt took 1.61 s with int4 KV against 0.48 s
with bf16, measured before this slack; benchmarks/results/2026-12-04-nvidia-h200-2.)"""


def default_device() -> torch.device:
    """The current CUDA device when there is one (and kernels are not interpreted), else the CPU."""
    if torch.cuda.is_available() and not triton_interpret():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: an indexed device compares equal to its tensors' devices and is what
    torch.Generator and the warm-up's worker threads need."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pool_sizes(plan: Mapping[str, Any], max_tokens: int | None = None,
               max_seqs: int | None = None) -> tuple[int, int]:
    """(compressed pages, residual pages) to allocate.

    Without ``max_tokens``: the planner's ``num_pages`` and
    ``num_residual_pages``. With it: about ``max_tokens`` tokens of pages
    (at most the plan's capacity), split in the planner's compressed :
    residual proportion, the residual pool holding at least a tail for
    ``max_seqs`` (default 4) sequences plus APPEND_SLACK_PAGES (at most a
    sixteenth of the pages) for long appends.
    """
    n_c, n_r = int(plan["num_pages"]), int(plan["num_residual_pages"])
    residual_tokens = (plan.get("scheme_params") or {}).get("residual_tokens")
    if max_tokens is None:
        return n_c, (n_r if residual_tokens is not None else 0)
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise KvgenRuntimeError(f"max_tokens must be a positive int, got {max_tokens!r}")
    P = int(plan["page_size"])
    total = -(-max_tokens // P)
    if residual_tokens is None:
        return max(1, min(total, n_c) if n_c else total), 0
    per_seq = int(residual_tokens) // P + 1
    seqs = MIN_RESIDUAL_SEQS if max_seqs is None else max(1, int(max_seqs))
    frac = n_r / (n_c + n_r) if n_c + n_r else 0.0
    r = max(math.ceil(total * frac), seqs * per_seq + min(APPEND_SLACK_PAGES, total // 16))
    c = max(total - r, 1)
    if n_c:
        c = min(c, n_c)
    return c, r


class PagePool:
    """Page storage of every layer: the scheme's compressed tensors, plus ``rk``/``rv`` for residual schemes.

    ``layers[i]`` is layer i's dict ``{name: tensor}``: the plan's
    ``page_tensors`` as ``[num_pages, H, *shape]`` and, when the scheme keeps
    a residual, ``rk``/``rv`` as ``[num_residual_pages, H, page, D]`` in the
    compute dtype (see :func:`.pools.allocate_pool`). This dict is what the
    kernels take as ``pools``.

    With ``staging_pages=R > 0`` (a host tier with cold pages) each
    compressed tensor is one allocation for all layers plus a staging ring
    of two slots of ``R`` pages after the last layer::

        [ layer 0: N pages | layer 1 | ... | layer L-1 | ring slot 0: R | ring slot 1: R ]

    ``layers[l][name]`` is still layer l's ``[N, H, *shape]`` slice;
    ``attention_view(l)`` extends layer l's slice to the end of the ring, so
    a kernel reading that view reaches ring page ``r`` of slot ``s`` as page
    id ``(L - l) * N + s * R + r`` (the two slots are shared by all layers:
    layer l's cold pages are staged into slot ``l % 2``).
    """

    def __init__(self, page_tensors: Sequence[Mapping[str, Any]], *, num_layers: int, num_pages: int,
                 num_residual_pages: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, residual: bool, zero: bool = False, staging_pages: int = 0) -> None:
        self.compressed_names = tuple(t["name"] for t in page_tensors)
        self.num_pages, self.num_residual_pages = num_pages, num_residual_pages if residual else 0
        self.staging_pages = staging_pages
        self.device = device
        self._ring_starts: torch.Tensor | None = None
        self.layers: list[dict[str, torch.Tensor]] = []
        self.ring: dict[str, torch.Tensor] = {}
        whole = None
        if staging_pages:
            whole = allocate_pool(page_tensors, num_layers * num_pages + 2 * staging_pages, num_kv_heads, dtype,
                                  device, zero=zero)
            self.ring = {n: t[num_layers * num_pages:] for n, t in whole.items()}
        self._attention: list[dict[str, torch.Tensor]] = []
        for layer in range(num_layers):
            if whole is None:
                pool = allocate_pool(page_tensors, num_pages, num_kv_heads, dtype, device, zero=zero)
            else:
                start = layer * num_pages
                pool = {n: t[start:start + num_pages] for n, t in whole.items()}
            if residual:
                shape = [page_size, head_dim]
                pool.update(allocate_pool([{"name": "rk", "dtype": "compute", "shape": shape},
                                           {"name": "rv", "dtype": "compute", "shape": shape}],
                                          num_residual_pages, num_kv_heads, dtype, device, zero=zero))
            self.layers.append(pool)
            if whole is not None:
                self._attention.append({**pool, **{n: t[layer * num_pages:] for n, t in whole.items()}})

    def attention_view(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s pools with the compressed tensors reaching into the staging ring (see above)."""
        return self._attention[layer]

    def ring_page(self, layer: int, position: int) -> int:
        """The page id, in ``attention_view(layer)``, of ring position ``position`` of ``layer``'s slot."""
        return (len(self.layers) - layer) * self.num_pages + (layer % 2) * self.staging_pages + position

    def ring_starts(self) -> torch.Tensor:
        """int32 ``[layers]`` on the pool's device: ``ring_page(layer, 0)`` of every layer (made once)."""
        if self._ring_starts is None:
            self._ring_starts = torch.tensor([self.ring_page(layer, 0) for layer in range(len(self.layers))],
                                             dtype=torch.int32).to(self.device)
        return self._ring_starts

    def named(self, layer: int, pool: str) -> dict[str, torch.Tensor]:
        """One pool's tensors of one layer by name (what the host tier copies)."""
        return dict(zip(self.compressed_names if pool == COMPRESSED else ("rk", "rv"), self.tensors(layer, pool)))

    def tensors(self, layer: int, pool: str) -> list[torch.Tensor]:
        """One pool's tensors of one layer, in kernel order (what page_copy takes)."""
        p = self.layers[layer]
        if pool == COMPRESSED:
            return [p[n] for n in self.compressed_names]
        if pool == RESIDUAL and "rk" in p:
            return [p["rk"], p["rv"]]
        raise KvgenRuntimeError(f"unknown pool {pool!r}; use {COMPRESSED!r} or {RESIDUAL!r}")

    def nbytes(self, pool: str | None = None) -> int:
        """Bytes over all layers (``pool``: only ``"compressed"`` or ``"residual"``)."""
        total = 0 if pool == RESIDUAL else pool_bytes(self.ring)
        for p in self.layers:
            if pool in (None, COMPRESSED):
                total += pool_bytes({n: p[n] for n in self.compressed_names})
            if pool in (None, RESIDUAL) and "rk" in p:
                total += pool_bytes({"rk": p["rk"], "rv": p["rv"]})
        return total
