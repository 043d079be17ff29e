"""Per-step metadata: one model step's block-manager decisions as device tensors.

``KVCache.plan_step`` is called once per model step (FlashInfer's plan/run
split). It asks the :class:`~.block_manager.BlockManager` for the step's
slots, works out the page copies and conversions, and uploads everything
the kernels need in two host-to-device copies. Every layer then reuses the
same :class:`StepMetadata`; the run methods read only Python ints and
tensors from it, so they never synchronize with the device and a layer loop
can be captured in a CUDA graph (device buffers are persistent and
grow-only: their addresses stay fixed while shapes fit).

Batch appends and the page-reuse hazard
----------------------------------------
The block manager releases a residual page the moment it schedules its
conversion (see :class:`~.block_manager.AppendPlan`), so a later append of
the same step could be handed that page for its new tokens; within a layer
the kernels run "copies, write, conversions", so that write would land
before the conversion read the page. :func:`reserve_step` therefore holds
every page released during the step (it parks them in private one-token
sequences, which take them straight off the top of the LIFO free list).
When an append finds no free residual page (a long prompt: every new token
of a residual scheme is written to a residual page first), it frees the
held pages and opens a new *phase*: per layer, phases run one after the
other, so the next write lands after the previous conversions. Almost every
step has one phase; a prompt longer than the free residual pool gets a few.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .block_manager import COMPRESSED, RESIDUAL, BlockManager
from .errors import KvgenRuntimeError, OutOfPages

_hold_ids = itertools.count()


@dataclass
class StepPhase:
    """Device form of a :class:`Phase`: write tokens ``[start, end)`` between the copies and conversions."""

    start: int
    end: int
    slot_mapping: torch.Tensor
    copies: list[tuple[str, torch.Tensor, torch.Tensor]]
    conversions: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class StepMetadata:
    """Everything the layers of one model step share; built by ``KVCache.plan_step``.

    Host fields (Python ints, safe to branch on): ``seq_ids``, ``num_new``
    (tokens each sequence adds), ``seq_lens_host``, ``batch``,
    ``max_seq_len``, ``max_q_len``, ``total_tokens``, ``max_pages``,
    ``is_decode`` (every sequence adds exactly one token), ``configs`` (kernel
    configs by op, chosen for this step's shape bucket), ``num_copies``,
    ``num_conversions``.

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


def _check_batch(bm: BlockManager, seq_ids: Sequence[Hashable], num_new: Sequence[int],
                 token_ids: Sequence[Sequence[int] | None] | None) -> None:
    if len(num_new) != len(seq_ids):
        raise KvgenRuntimeError(
            f"plan_step got {len(seq_ids)} sequence ids and {len(num_new)} token counts; pass one count per sequence")
    if len(set(seq_ids)) != len(seq_ids):
        raise KvgenRuntimeError("plan_step got a sequence id twice; each sequence appears once per step")
    for n in num_new:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise KvgenRuntimeError(f"plan_step token counts must be ints >= 0, got {n!r}")
    if token_ids is not None:
        if len(token_ids) != len(seq_ids):
            raise KvgenRuntimeError(
                f"plan_step got token ids for {len(token_ids)} sequences, expected {len(seq_ids)} (or None)")
        for sid, toks, n in zip(seq_ids, token_ids, num_new):
            if toks is not None and len(toks) != n:
                raise KvgenRuntimeError(
                    f"plan_step: sequence {sid!r} adds {n} tokens but got {len(toks)} token ids")
    for sid in seq_ids:
        bm.seq_len(sid)  # raises UnknownSequence before anything changes


def _precheck(bm: BlockManager, seq_ids: Sequence[Hashable], num_new: Sequence[int]) -> None:
    """Raise OutOfPages unless :func:`reserve_step` can certainly serve the whole step.

    Without a residual pool every append takes ``new pages (+1 copy-on-write
    of a shared tail page)`` from the write pool. With one, a long append may
    be cut into chunks (see :func:`reserve_step`), so a sequence takes from
    the free pool at its peak at most ``min(new pages (+1 copy), window + 1 -
    residual pages it owns alone)`` and keeps what it holds at the end
    beyond its own pages at the start. Conservative: a shared tail page is
    counted as copied by every sharer, every conversion as taking a fresh
    compressed page.
    """
    P = bm.page_size
    residual = bm.residual_tokens is not None
    window = bm.residual_tokens // P if residual else 0
    free_w = bm.num_free_pages(bm.write_pool)
    acc = peak = need_c = 0
    for sid, n in zip(seq_ids, num_new):
        n0 = bm.seq_len(sid)
        n1 = n0 + n
        new_pages = -(-n1 // P) - -(-n0 // P)
        cow = 0
        if n > 0 and n0 % P and bm.ref_count(bm.write_pool, bm.block_table(sid)[n0 // P]) > 1:
            cow = 1
        if not residual:
            acc += new_pages + cow
            continue
        nc0 = bm.num_compressed(sid)
        nc1 = max(nc0, bm.compressed_pages(n1))
        held0 = -(-n0 // P) - nc0
        held1 = -(-n1 // P) - nc1
        # Residual pages shared with other sequences (forks) are not freed when this one
        # converts them; only its own pages are recycled.
        table = bm.block_table(sid)
        shared = [i for i in range(nc0, len(table)) if bm.ref_count(RESIDUAL, table[i]) > 1]
        own0 = held0 - len(shared)
        shared_left = sum(1 for i in shared if i >= nc1) - (1 if cow and n0 // P >= nc1 else 0)
        # Chunked, a sequence never holds more than window + 1 residual pages at once: a chunk
        # filling page window + 1 converts the oldest one, which a later chunk reuses.
        extra = min(new_pages + cow, max(0, window + 1 - own0))
        peak = max(peak, acc + extra)
        acc += held1 - own0 - shared_left
        need_c += nc1 - nc0
    peak = max(peak, acc)
    if peak > free_w:
        raise OutOfPages(
            f"the {bm.write_pool} pool is out of pages: this step of {len(seq_ids)} sequence(s) needs up to "
            f"{peak} page(s), {free_w} free or evictable; free (preempt) a sequence and retry, "
            f"or give the cache more pages (max_tokens)")
    if residual:
        avail_c = bm.num_free_pages(COMPRESSED)
        if need_c > avail_c:
            raise OutOfPages(
                f"the {COMPRESSED} pool is out of pages: this step of {len(seq_ids)} sequence(s) converts up to "
                f"{need_c} page(s), {avail_c} free or evictable; free (preempt) a sequence and retry, "
                f"or give the cache more pages (max_tokens)")


@dataclass
class Phase:
    """Tokens ``[start, end)`` of the step (in step order) and the page work around their write.

    Per layer a phase runs its ``copies``, writes its tokens, then runs its
    ``conversions``; phases run in order. A new phase starts only when an
    append needs a residual page that an earlier conversion of the step has
    released: its write then lands after that conversion has read the page.
    """

    start: int
    end: int = 0
    copies: list[tuple[str, int, int]] = field(default_factory=list)
    conversions: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Reservation:
    """What :func:`reserve_step` decided: every new token's slot (step order) and the phases."""

    slots: list[int]
    phases: list[Phase]


def _fit(bm: BlockManager, seq_id: Hashable, want: int) -> int:
    """How many of ``want`` tokens one append can place in the residual pool's free pages now."""
    P = bm.page_size
    n0 = bm.seq_len(seq_id)
    free = bm.num_free_pages(RESIDUAL)
    if n0 % P and bm.ref_count(RESIDUAL, bm.block_table(seq_id)[n0 // P]) > 1:
        free -= 1  # the shared tail page is copied first
        if free < 0:
            return 0
    room = (-(-n0 // P) + free) * P - n0  # the tail page's free slots plus whole free pages
    return max(0, min(want, room))


def reserve_step(bm: BlockManager, seq_ids: Sequence[Hashable], num_new: Sequence[int],
                 token_ids: Sequence[Sequence[int] | None] | None = None) -> Reservation:
    """Append for every sequence of a step, all or nothing.

    Raises :class:`OutOfPages` (or another KvgenRuntimeError for bad
    arguments) before changing anything. For a residual scheme every new
    token is written to a residual page first; an append that does not fit
    the residual pool's free pages (a long prompt) is cut into chunks, and
    the pages one chunk's conversions release are reused by the next chunk
    in a new phase.
    """
    _check_batch(bm, seq_ids, num_new, token_ids)
    _precheck(bm, seq_ids, num_new)
    residual = bm.residual_tokens is not None
    slots: list[int] = []
    phases = [Phase(0)]
    holds: list[Hashable] = []
    offset = 0
    try:
        for i, (sid, n) in enumerate(zip(seq_ids, num_new)):
            toks = None if token_ids is None or token_ids[i] is None else list(token_ids[i])
            done = 0
            while True:
                chunk = n - done
                if residual and chunk:
                    chunk = _fit(bm, sid, chunk)
                    if chunk == 0:
                        if not holds:
                            raise KvgenRuntimeError(
                                "internal error: the residual pool ran dry after the page check; report this bug")
                        for h in holds:  # later writes run after this phase's conversions
                            bm.free(h)
                        holds.clear()
                        phases[-1].end = offset
                        phases.append(Phase(offset))
                        continue
                before = bm.block_table(sid) if residual else None
                nc0 = bm.num_compressed(sid) if residual else 0
                plan = bm.append(sid, chunk, None if toks is None else toks[done:done + chunk])
                slots.extend(plan.slots)
                phases[-1].copies.extend(plan.copies)
                phases[-1].conversions.extend(plan.conversions)
                if residual and plan.conversions:
                    # Residual pages this append touched that no table references any more: the
                    # converted ones (and ones a prefix-cache hit replaced), now on the free list.
                    P = bm.page_size
                    touched = set(before[nc0:]) | {slot // P for slot in plan.slots} | {d for _, _, d in plan.copies}
                    kept = set(bm.block_table(sid)[bm.num_compressed(sid):])
                    released = {p for p in touched - kept if bm.ref_count(RESIDUAL, p) == 0}
                    if released & {src for src, _ in plan.conversions}:
                        holds.extend(_hold(bm, released))
                done += chunk
                offset += chunk
                if done >= n:
                    break
        phases[-1].end = offset
    finally:
        for h in holds:
            bm.free(h)
    return Reservation(slots, phases)


def _hold(bm: BlockManager, released: set[int]) -> list[Hashable]:
    """Park the pages just released (on top of the LIFO free list) in private sequences."""
    ids = []
    for _ in range(len(released)):
        hid = ("__kvgen_hold__", next(_hold_ids))
        bm.add_sequence(hid)
        bm.append(hid, 1)
        ids.append(hid)
    got = {bm.block_table(h)[0] for h in ids}
    if got != released:  # the free list did not hand back what was released: never write into a page pending conversion
        for h in ids:
            bm.free(h)
        raise KvgenRuntimeError(
            "internal error: could not hold the residual pages released during this step; report this bug")
    return ids


def build_step(index: int, bm: BlockManager, buffers: DeviceBuffers, seq_ids: Sequence[Hashable],
               num_new: Sequence[int], reservation: Reservation) -> StepMetadata:
    """Pack the step's tables and lists into two uploads and slice the device views."""
    B = len(seq_ids)
    tables = [bm.block_table(s) for s in seq_ids]
    lens = [bm.seq_len(s) for s in seq_ids]
    ncomp = [bm.num_compressed(s) for s in seq_ids]
    max_pages = max([len(t) for t in tables] + [1])
    slots = reservation.slots
    cu = [0]
    for n in num_new:
        cu.append(cu[-1] + n)

    flat: list[int] = []
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (max_pages - len(t)))
    offsets: dict[str, tuple[int, int]] = {"block_tables": (0, B * max_pages)}

    def put(name: str, values: list[int]) -> None:
        offsets[name] = (len(flat), len(values))
        flat.extend(values)

    put("seq_lens", lens)
    put("num_compressed", ncomp)
    put("cu_seqlens_q", cu)
    for i, ph in enumerate(reservation.phases):
        put(f"{i}/conv_src", [src for src, _ in ph.conversions])
        put(f"{i}/conv_dst", [dst for _, dst in ph.conversions])
        for pool in sorted({c[0] for c in ph.copies}):
            put(f"{i}/copy_src/{pool}", [src for p, src, _ in ph.copies if p == pool])
            put(f"{i}/copy_dst/{pool}", [dst for p, _, dst in ph.copies if p == pool])
    dev32 = buffers.upload(torch.tensor(flat, dtype=torch.int32))
    dev64 = buffers.upload(torch.tensor(slots, dtype=torch.int64))

    def view(name: str) -> torch.Tensor:
        start, n = offsets[name]
        return dev32[start:start + n]

    phases = []
    for i, ph in enumerate(reservation.phases):
        copies = [(pool, view(f"{i}/copy_src/{pool}"), view(f"{i}/copy_dst/{pool}"))
                  for pool in sorted({c[0] for c in ph.copies})]
        conversions = (view(f"{i}/conv_src"), view(f"{i}/conv_dst")) if ph.conversions else None
        phases.append(StepPhase(ph.start, ph.end, dev64[ph.start:ph.end], copies, conversions))
    return StepMetadata(
        index=index, seq_ids=tuple(seq_ids), num_new=tuple(num_new), seq_lens_host=tuple(lens), batch=B,
        max_seq_len=max(lens + [0]), max_q_len=max(list(num_new) + [0]), total_tokens=len(slots),
        max_pages=max_pages, is_decode=B > 0 and all(n == 1 for n in num_new),
        block_tables=view("block_tables").view(B, max_pages), seq_lens=view("seq_lens"),
        num_compressed=view("num_compressed"), cu_seqlens_q=view("cu_seqlens_q"), slot_mapping=dev64,
        phases=phases, num_copies=sum(len(ph.copies) for ph in reservation.phases),
        num_conversions=sum(len(ph.conversions) for ph in reservation.phases))
