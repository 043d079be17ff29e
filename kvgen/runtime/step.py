"""Per-step metadata: one model step's block-manager decisions as device tensors.

``KVCache.plan_step`` is called once per model step (FlashInfer's plan/run
split). It asks the :class:`~.block_manager.BlockManager` for the step's
slots, works out the page copies and conversions, and uploads everything
the kernels need in two host-to-device copies. Every layer then reuses the
same :class:`StepMetadata`; the run methods read only Python ints and
tensors from it, so they never synchronize with the device and a layer loop
can be captured in a CUDA graph (device buffers are persistent and
grow-only: their addresses stay fixed while shapes fit).

The step's page decisions themselves (which slots, copies, conversions and
phases) are the block manager's: :meth:`~.block_manager.BlockManager.reserve_step`.
This module only packs them, with the block tables and lengths, into device
tensors.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .block_manager import BlockManager, StepPlan
from .host_tier import ColdStage


@dataclass
class StepPhase:
    """Device form of a :class:`~.block_manager.Phase`: write tokens ``[start, end)`` between the copies and conversions."""

    start: int
    end: int
    slot_mapping: torch.Tensor
    copies: list[tuple[str, torch.Tensor, torch.Tensor]]
    conversions: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class DecodeRows:
    """The one-token sequences of a step that also runs longer chunks (a mixed step), for the decode kernel.

    The prefill kernel gives each sequence at least one query block, a tile of ~128 query rows with one
    program per KV head and no split of the keys: a sequence adding one token reads its whole cache
    through one program a head with a few rows of the tile in use (H200, Llama-3-8B shape, 11 int4 rows
    of 34K tokens beside a 32K prompt's chunks: some 60 ms more a chunk step than with the decode kernel,
    benchmarks/experiments/mixed_step.py). The decode kernel reads them as a decode step does.

    ``rows``: their indices in the step (host ints); ``index``: the same, int64 on the device;
    ``q_rows``: int64, their rows of the step's q/out; ``block_tables`` (the step's, without cold pages),
    ``seq_lens``, ``num_compressed``: int32, theirs; ``max_seq_len``: theirs (host).
    """

    rows: tuple[int, ...]
    index: torch.Tensor
    q_rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_compressed: torch.Tensor
    max_seq_len: int


@dataclass
class StepMetadata:
    """Everything the layers of one model step share; built by ``KVCache.plan_step``.

    Host fields (Python ints, safe to branch on): ``seq_ids``, ``num_new``
    (tokens each sequence adds), ``seq_lens_host``, ``batch``,
    ``max_seq_len``, ``max_q_len``, ``total_tokens``, ``max_pages``,
    ``is_decode`` (every sequence adds exactly one token), ``configs`` (kernel
    configs by op, chosen for this step's shape bucket; ``prefill/fresh`` and
    ``prefill/pages``: the prefill config refined by the module's
    ``step_config`` for this step, once), ``num_copies``,
    ``num_conversions``, ``written`` (layers whose K/V are stored), ``stale``.

    Device tensors: ``block_tables`` int32 ``[B, max_pages]``, ``seq_lens``,
    ``num_compressed`` int32 ``[B]``, ``cu_seqlens_q`` int32 ``[B+1]``,
    ``slot_mapping`` int64 ``[total_tokens]``, and ``phases`` (almost always
    one): per phase its slice of the slot mapping, copy-on-write copies
    ``(pool, src, dst)`` run before its write, and conversions ``(src, dst)``
    run after it (int32 ``[M]``).
    """

    index: int
    seq_ids: tuple
    num_new: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    batch: int
    max_seq_len: int
    max_q_len: int
    total_tokens: int
    max_pages: int
    is_decode: bool
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_compressed: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    phases: list[StepPhase] = field(default_factory=list)
    num_copies: int = 0
    num_conversions: int = 0
    configs: dict[str, Any] = field(default_factory=dict)
    written: set = field(default_factory=set)
    stale: str | None = None
    """Why the step may no longer run (a sequence of it was freed after planning), else None."""
    cold: ColdStage | None = None
    """The step's cold pages (host tier) and per-layer block tables reaching the staging ring; None when
    no sequence of the step has cold pages (then nothing about the host tier costs anything)."""
    pre_view: tuple[torch.Tensor, torch.Tensor] | None = None
    """The step's ``(block_tables, num_compressed)`` before its conversions, once a decode computed it
    (:mod:`.preconversion`); None until then."""
    decode_rows: DecodeRows | None = None
    """A mixed step's one-token sequences (see :class:`DecodeRows`); None unless some sequence adds one
    token and another adds more."""


class DeviceBuffers:
    """Persistent, grow-only flat device buffers, one per dtype.

    ``upload(host)`` copies a 1-D host tensor into the front of the buffer of
    its dtype and returns that slice; the address is stable until a larger
    upload forces a reallocation (then the old step's views stay valid: they
    keep the old storage alive).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self._pin = device.type == "cuda"

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        n = host.numel()
        buf = self._bufs.get(host.dtype)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 2 * (buf.numel() if buf is not None else 0), 256),
                              dtype=host.dtype, device=self.device)
            self._bufs[host.dtype] = buf
        out = buf[:n]
        if self._pin:
            # A fresh pinned tensor per step: the caching host allocator keeps it
            # alive until the asynchronous copy has read it.
            host = host.pin_memory()
            out.copy_(host, non_blocking=True)
        else:
            out.copy_(host)
        return out


_PAD = array("i", bytes(16))  # four zeros: alignment padding


def _host_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor over ``values``' buffer (no per-element conversion); empty arrays included."""
    if not len(values):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)


def _cold_order(tables: Sequence[Sequence[int]], host_pages: Sequence[int],
                max_pages: int) -> tuple[list[tuple[int, int, int]], array]:
    """The cold entries of a step in host-id order: ``(runs, at)``.

    Entry ``j`` (ring position ``j``) is the ``j``-th smallest host page of
    the leading ``host_pages[b]`` entries of every table ``b``; ``at[j]`` is
    its flat block-table index ``b * max_pages + i``; ``runs`` are
    :func:`~.host_tier.runs` of ``(host page, position)``: ``(host start,
    position start, n)`` with consecutive host ids.
    """
    host, at = array("i"), array("i")
    for b, n in enumerate(host_pages):
        if n:
            host.extend(tables[b][:n])
            at.extend(range(b * max_pages, b * max_pages + n))
    h = torch.frombuffer(host, dtype=torch.int32).long()
    order = torch.argsort(h, stable=True)
    h = h[order]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(h[1:] != h[:-1] + 1).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([h.numel()])])
    cold_runs = list(zip(h[starts].tolist(), starts.tolist(), (ends - starts).tolist()))
    return cold_runs, array("i", torch.frombuffer(at, dtype=torch.int32)[order].tolist())


def layer_tables(block_tables: torch.Tensor, cold_at: torch.Tensor, page_pool: Any, batch: int,
                 max_pages: int) -> torch.Tensor:
    """int32 ``[layers, batch, max_pages]``: the step's table per layer, cold entries pointing into the ring.

    ``cold_at[j]`` is the flat table index of ring position ``j``; the ring
    page is affine in the position (:meth:`~.page_pool.PagePool.ring_page`),
    so every layer's copy is a few tensor ops on the tables' device.
    """
    num_layers = len(page_pool.layers)
    tabs = block_tables.reshape(1, -1).repeat(num_layers, 1)
    pos = torch.arange(cold_at.numel(), dtype=torch.int32, device=block_tables.device)
    tabs[:, cold_at.long()] = page_pool.ring_starts()[:, None] + pos[None, :]
    return tabs.view(num_layers, batch, max_pages)


def cold_pages(bm: BlockManager, seq_ids: Sequence[Hashable]) -> int:
    """Cold pages (host tier) the sequences of a step hold in all: what the staging ring must fit."""
    return sum(bm.host_pages(s) for s in seq_ids)


def build_step(index: int, bm: BlockManager, buffers: DeviceBuffers, seq_ids: Sequence[Hashable],
               num_new: Sequence[int], reservation: StepPlan, page_pool: Any = None,
               on_cold: Callable[[ColdStage], None] | None = None) -> StepMetadata:
    """Pack the step's tables and lists into two uploads and slice the device views.

    With a ``page_pool`` that has a staging ring and sequences with cold
    pages, also one block table per layer whose cold entries point into the
    ring (``step.cold``; see :class:`~.page_pool.PagePool`), and
    ``on_cold(cold)`` is called as soon as the cold runs are known, before
    anything else is packed: the caller starts the first layers' copies
    there, so they overlap this function's host work.
    """
    B = len(seq_ids)
    tables, lens, ncomp = bm.step_view(seq_ids)  # the manager's arrays: read here, never kept
    max_pages = max(max(map(len, tables), default=0), 1)
    slots = reservation.slots
    cu = [0]
    for n in num_new:
        cu.append(cu[-1] + n)

    # One int32 host buffer (array: C-speed extends, no per-element tensor conversion), one upload.
    flat = array("i")
    zeros = array("i", bytes(4 * max_pages))
    for t in tables:
        flat.extend(t)
        if len(t) < max_pages:
            flat.extend(zeros[:max_pages - len(t)])
    offsets: dict[str, tuple[int, int]] = {"block_tables": (0, B * max_pages)}

    def put(name: str, values, align: int = 4) -> None:
        # Sections start on 16-byte boundaries: Triton compiles a kernel variant per pointer alignment, so
        # unaligned sections would make the batch size pick new variants (a JIT compile on a request's path).
        flat.extend(_PAD[:-len(flat) % align])
        offsets[name] = (len(flat), len(values))
        flat.extend(values)

    cold = None
    host_pages = [bm.host_pages(s) for s in seq_ids] if page_pool is not None and page_pool.staging_pages else []
    if any(host_pages):
        # (host page, flat index of its block-table entry) for every cold entry. Ring positions follow
        # the host ids' order, so consecutive host pages land in consecutive ring pages and one copy
        # moves each run: a reused host pool hands out ids in any order (LIFO: descending), and ring
        # positions in table order then made every run one page long (H200: 131K page copies per
        # step, 1.1 s instead of 0.16 s at 50% cold).
        # Tensor ops, not Python over every entry: this runs before the step's first copies start.
        cold_runs, cold_at = _cold_order(tables, host_pages, max_pages)
        cold = ColdStage(cold_runs)
        if on_cold is not None:
            on_cold(cold)
        # The per-layer tables are built on the device from the step's table and these positions
        # (below): built on the host they cost ~4 ms per step on the H200 at a 16K-token batch with a
        # quarter of its pages cold, time in which the link idled.
        put("cold_at", cold_at)
    put("seq_lens", lens)
    put("num_compressed", ncomp)
    put("cu_seqlens_q", cu)
    for i, ph in enumerate(reservation.phases):
        put(f"{i}/conv_src", [src for src, _ in ph.conversions])
        put(f"{i}/conv_dst", [dst for _, dst in ph.conversions])
        for pool in sorted({c[0] for c in ph.copies}):
            put(f"{i}/copy_src/{pool}", [src for p, src, _ in ph.copies if p == pool])
            put(f"{i}/copy_dst/{pool}", [dst for p, _, dst in ph.copies if p == pool])
    dev32 = buffers.upload(_host_tensor(flat, torch.int32))
    # a mixed step's one-token rows: their step indices and q rows go up with the slot mapping (int64 for
    # index_select / index_copy_)
    ones = [b for b, n in enumerate(num_new) if n == 1] if any(n > 1 for n in num_new) else []
    dev64 = buffers.upload(_host_tensor(array("q", slots + ones + [cu[b] for b in ones]), torch.int64))

    def view(name: str) -> torch.Tensor:
        start, n = offsets[name]
        return dev32[start:start + n]

    if cold is not None:
        cold.tables = layer_tables(view("block_tables"), view("cold_at"), page_pool, B, max_pages)
    phases = []
    for i, ph in enumerate(reservation.phases):
        copies = [(pool, view(f"{i}/copy_src/{pool}"), view(f"{i}/copy_dst/{pool}"))
                  for pool in sorted({c[0] for c in ph.copies})]
        conversions = (view(f"{i}/conv_src"), view(f"{i}/conv_dst")) if ph.conversions else None
        phases.append(StepPhase(ph.start, ph.end, dev64[ph.start:ph.end], copies, conversions))
    decode_rows = None
    if ones:
        n = len(slots)
        rows = dev64[n:n + len(ones)]
        decode_rows = DecodeRows(tuple(ones), rows, dev64[n + len(ones):n + 2 * len(ones)],
                                 view("block_tables").view(B, max_pages).index_select(0, rows),
                                 view("seq_lens").index_select(0, rows), view("num_compressed").index_select(0, rows),
                                 max(lens[b] for b in ones))
    return StepMetadata(
        index=index, seq_ids=tuple(seq_ids), num_new=tuple(num_new), seq_lens_host=tuple(lens), batch=B,
        max_seq_len=max(lens, default=0), max_q_len=max(num_new, default=0), total_tokens=len(slots),
        max_pages=max_pages, is_decode=B > 0 and all(n == 1 for n in num_new),
        block_tables=view("block_tables").view(B, max_pages), seq_lens=view("seq_lens"),
        num_compressed=view("num_compressed"), cu_seqlens_q=view("cu_seqlens_q"), slot_mapping=dev64[:len(slots)],
        phases=phases, num_copies=sum(len(ph.copies) for ph in reservation.phases),
        num_conversions=sum(len(ph.conversions) for ph in reservation.phases), cold=cold, decode_rows=decode_rows)
