"""The host tier's tensors and copies: a second page pool in host memory, and the device staging ring.

:class:`HostPool` holds pages in the device pools' own format (the plan's
page tensors, so int4 pages travel as int4; ``rk``/``rv`` for a residual
scheme's tail pages), layer-major::

    host[name]   [num_layers, num_host_pages, H, *shape]    pinned on CUDA, ordinary memory on the CPU

so that the pages of one layer with consecutive host ids are one contiguous
range: a transfer moves a layer's pages in a few large copies (one per run of
consecutive host ids; a fresh pool hands out ids in order, so a swapped-out
sequence is usually one run).

:class:`HostTier` executes the block manager's :class:`~.tiering.TransferPlan`
(runs that are consecutive on both sides are copied directly; scattered
device pages are gathered/scattered on the device first, so only the host
side needs runs) and stages cold pages: ``stage(layer, cold)`` copies a step's
cold pages of one layer into slot ``layer % 2`` of the staging ring, which
the compressed pool allocates right after the last layer's pages (see
:class:`~.page_pool.PagePool`). On CUDA every copy runs on one side stream,
ordered after the work already queued on the compute stream, and returns an
event; the compute stream waits on that event only where it reads (or
rewrites) the pages -- so swaps and the next layer's staging overlap decode.
One stream for all host traffic keeps host-page reuse ordered (a host page
freed by a swap-in and reused by a later swap-out is read before it is
rewritten). On the CPU every copy is synchronous.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .tiering import TransferPlan


MIN_DIRECT_RUN = 16
"""Pages per run (on average) from which swaps copy device runs directly instead of gathering them
(16 pages of a bf16 K tensor at 8 KV heads, D=128 are 512 KiB: far above the size where a copy's fixed
cost matters); shorter runs are gathered by a kernel first."""


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(host, other)`` pairs sorted by host id -> ``(host start, other start, n)`` where both ascend by 1."""
    out: list[list[int]] = []
    for h, o in pairs:
        if out and out[-1][0] + out[-1][2] == h and out[-1][1] + out[-1][2] == o:
            out[-1][2] += 1
        else:
            out.append([h, o, 1])
    return [tuple(r) for r in out]


class HostPool:
    """Host copies of the page format: ``tensors[pool][name]`` is ``[num_layers, pages, H, *shape]``."""

    def __init__(self, device_layer: Mapping[str, torch.Tensor], compressed_names: Sequence[str],
                 num_layers: int, num_pages: int, num_residual_pages: int, pin: bool) -> None:
        self.tensors: dict[str, dict[str, torch.Tensor]] = {"compressed": {}, "residual": {}}
        for pool, names, n in (("compressed", compressed_names, num_pages),
                               ("residual", [x for x in ("rk", "rv") if x in device_layer], num_residual_pages)):
            for name in names:
                t = device_layer[name]
                shape = (num_layers, n, *t.shape[1:])  # pinned: not zero-filled (GBs); every page is written first
                self.tensors[pool][name] = (torch.empty(shape, dtype=t.dtype, pin_memory=True) if pin
                                            else torch.zeros(shape, dtype=t.dtype))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.tensors.values() for t in p.values())


@dataclass
class ColdStage:
    """A step's cold pages: ``runs`` (host start, ring position, n) and per-layer block tables.

    ``tables[layer]`` is the step's block table with every cold entry
    pointing into the staging ring as seen from that layer's attention view.
    """

    runs: list[tuple[int, int, int]]
    tables: torch.Tensor | None = None


class HostTier:
    """Runs transfers between a :class:`~.page_pool.PagePool` and its :class:`HostPool`.

    The ring's two slots are shared by every step, so the tier keeps what
    each holds: ``(runs, layer, event)``. Host pages change only through
    :meth:`run`, which forgets both; until then a slot holding layer ``l``
    of the same ``runs`` holds the right pages for any step, so a copy
    staged ahead by one step (the next step's first layers) serves the next.
    """

    def __init__(self, page_pool, num_host_pages: int, num_host_residual_pages: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.page_pool = page_pool
        self.pool = HostPool(page_pool.layers[0], page_pool.compressed_names, len(page_pool.layers),
                             num_host_pages, num_host_residual_pages, pin=self.cuda)
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots: list[tuple | None] = [None, None]  # per ring slot: (runs, layer, event) it holds
        self.num_staged = 0
        """Layers of cold pages copied into the ring so far (each layer of a step once, unless host pages changed)."""

    def run(self, plan: TransferPlan):
        """Run ``plan.to_host`` then ``plan.to_device`` for every layer; an event (CUDA) or None."""
        if not plan.to_host and not plan.to_device:
            return None
        self._slots = [None, None]  # host pages are being freed or rewritten: what the ring holds may be stale
        if not self.cuda:
            self._to_host(plan.to_host)
            self._to_device(plan.to_device)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._to_host(plan.to_host)
            self._to_device(plan.to_device)
            return self.stream.record_event()

    def holds(self, layer: int, runs: list) -> bool:
        """Whether ring slot ``layer % 2`` holds (or is being given) ``layer``'s pages of ``runs``."""
        held = self._slots[layer % 2]
        return held is not None and held[1] == layer and (held[0] is runs or held[0] == runs)

    def stage(self, layer: int, runs: list) -> None:
        """Copy ``layer``'s cold pages of ``runs`` into ring slot ``layer % 2``, unless the slot holds them.

        On CUDA the copy waits for every reader of the slot already queued on
        the compute stream; call it only when no reader of the slot's present
        pages is still to be queued.
        """
        if self.holds(layer, runs):
            return
        slot = layer % 2
        self.num_staged += 1
        if not self.cuda:
            self._stage(layer, runs, slot)
            self._slots[slot] = (runs, layer, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the slot's last reader is queued
        with torch.cuda.stream(self.stream):
            self._stage(layer, runs, slot)
            self._slots[slot] = (runs, layer, self.stream.record_event())

    def ensure(self, layer: int, runs: list) -> None:
        """Make ``layer``'s cold pages of ``runs`` readable by the compute stream (staging them if needed)."""
        self.stage(layer, runs)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._slots[layer % 2][2])

    def stage_layer_one_ahead(self) -> None:
        """Slot 0 holds layer 0 of some cold pages (staged ahead by the last step): stage their layer 1 too.

        Called as a step starts being planned: the link copies while the host
        plans, and the step takes the copy if its cold pages are the same.
        """
        held = self._slots[0]
        if held is not None and held[1] == 0 and len(self.page_pool.layers) > 1:
            self.stage(1, held[0])

    # -- copies -------------------------------------------------------------
    def _stage(self, layer: int, runs: list, slot: int) -> None:
        base = slot * self.page_pool.staging_pages
        for name, ring in self.page_pool.ring.items():
            src = self.pool.tensors["compressed"][name][layer]
            for h, r, n in runs:
                ring[base + r:base + r + n].copy_(src[h:h + n], non_blocking=self.cuda)

    def _groups(self, items: Sequence[tuple[str, int, int]], host_index: int):
        """Per pool: (device ids tensor or None, runs) with the host ids ascending.

        When the device ids also ascend in long runs (a sequence filled at
        once and swapped whole), ``runs`` are ``(host start, device start, n)``
        and the tensor is None: each run is one copy between the two tiers on
        the copy engine. Otherwise ``runs`` are ``(host start, position, n)``
        over the device pages gathered (``index_select``) into one buffer: a
        kernel, which competes with decode for the SMs, but no copy shorter
        than the host runs.
        """
        by_pool: dict[str, dict[int, tuple[int, int]]] = {}
        for item in items:
            dev, host = (item[1], item[2]) if host_index == 2 else (item[2], item[1])
            # Keyed by the copy's destination, the plan's last copy to it wins: two prefix spills of one
            # plan can land on the same host page (the second evicts the first from the host's cache and
            # is the one registered there), and sorting both by ids ran them in device-id order instead.
            by_pool.setdefault(item[0], {})[host if host_index == 2 else dev] = (host, dev)
        for pool, by_dst in by_pool.items():
            pairs = sorted(by_dst.values())
            direct = runs(pairs)
            if len(pairs) >= MIN_DIRECT_RUN * len(direct):
                yield pool, None, direct
                continue
            idx = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
            yield pool, idx, runs([(h, j) for j, (h, _) in enumerate(pairs)])

    def _to_host(self, items: Sequence[tuple[str, int, int]]) -> None:
        for pool, idx, rs in self._groups(items, 2):
            for layer in range(len(self.page_pool.layers)):
                for name, dev_t in self.page_pool.named(layer, pool).items():
                    src = dev_t if idx is None else dev_t.index_select(0, idx)
                    dst = self.pool.tensors[pool][name][layer]
                    for h, j, n in rs:
                        dst[h:h + n].copy_(src[j:j + n], non_blocking=self.cuda)

    def _to_device(self, items: Sequence[tuple[str, int, int]]) -> None:
        for pool, idx, rs in self._groups(items, 1):
            for layer in range(len(self.page_pool.layers)):
                for name, dev_t in self.page_pool.named(layer, pool).items():
                    src = self.pool.tensors[pool][name][layer]
                    if idx is None:
                        for h, d, n in rs:
                            dev_t[d:d + n].copy_(src[h:h + n], non_blocking=self.cuda)
                        continue
                    tmp = torch.empty((idx.numel(), *dev_t.shape[1:]), dtype=dev_t.dtype, device=self.device)
                    for h, j, n in rs:
                        tmp[j:j + n].copy_(src[h:h + n], non_blocking=self.cuda)
                    dev_t.index_copy_(0, idx, tmp)
