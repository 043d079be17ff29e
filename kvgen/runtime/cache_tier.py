"""KVCache's host-tier operations: swap, cold pages, transfers in flight (a mixin of :class:`~.cache.KVCache`).

The block manager decides (:mod:`.tiering`); :class:`~.host_tier.HostTier`
copies; this mixin ties them to the cache's steps. On CUDA, copies run on the
host tier's side stream and the compute stream waits on their events only
where it must: a step naming a sequence whose pages are arriving
(``_arrivals``), a step whose writes reuse pages a spill copies out, and
attention reading staged cold pages. Device pages a copy to the host still
reads stay held in the block manager until that copy's event fires
(``_held``, released by ``_reap``). Without a host tier nothing here runs:
``plan_step`` and the layer ops take their usual path.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .block_manager import COMPRESSED, RESIDUAL
from .errors import KvgenRuntimeError, OutOfPages, seq_id_list
from .step import StepMetadata, cold_pages
from .tiering import TransferPlan


class HostTierMixin:
    """Host-tier methods of KVCache (it provides block_manager, page_pool, host_tier, step, device...)."""

    def _host_sizes(self, host_tokens: int | str | None, staging_tokens: int | None) -> tuple[int, int, int]:
        """(host compressed pages, host residual pages, staging ring pages per slot)."""
        if host_tokens is None:
            if staging_tokens:
                raise KvgenRuntimeError("staging_tokens needs a host tier; pass host_tokens=N too")
            return 0, 0, 0
        if host_tokens == "plan":
            per_token = int(self.plan.get("kv_bytes_per_token_per_gpu") or 0)
            host_tokens = int(self.plan.get("host_tier_bytes") or 0) // per_token if per_token else 0
            if host_tokens <= 0:
                raise KvgenRuntimeError("the plan has no host tier (host_tier_bytes is 0); pass host_tokens=N")
        if not isinstance(host_tokens, int) or isinstance(host_tokens, bool) or host_tokens <= 0:
            raise KvgenRuntimeError(f"host_tokens must be a positive int or 'plan', got {host_tokens!r}")
        P = self.page_size
        pages = -(-host_tokens // P)
        # A swapped-out sequence of a residual scheme keeps its tail and window pages as residual pages.
        residual = self.num_residual_pages if self.residual_tokens is not None else 0
        if staging_tokens is None:  # the ring is extra device memory: a quarter of one layer's pages
            staging = min(pages, max(1, self.num_pages // 4))
        elif not isinstance(staging_tokens, int) or isinstance(staging_tokens, bool) or staging_tokens < 0:
            raise KvgenRuntimeError(f"staging_tokens must be an int >= 0, got {staging_tokens!r}")
        else:
            staging = -(-staging_tokens // P)
        return pages, residual, staging

    def wait_host_tier(self) -> None:
        """Block until every copy between the tiers has finished, and hand out the pages they held.

        Never needed for correctness (steps wait where they must, without
        blocking the host); for benchmarks and tests that count pages. A
        no-op without a host tier or on the CPU.
        """
        if self.host_tier is not None and self.host_tier.cuda:
            self._reap(wait=True)
            for ev in set(self._arrivals.values()):
                ev.synchronize()

    def swap_out(self, seq_ids: Sequence[Hashable]) -> None:
        """Move the sequences' pages to the host tier (all or nothing; OutOfPages if it lacks room).

        They keep their tokens but may not be stepped until :meth:`swap_in`.
        On CUDA the copies run on the host tier's side stream and overlap
        later steps; the freed device pages are handed out only once the
        copies have read them.
        """
        ids = seq_id_list(seq_ids, "swap_out")
        tier = self._tier("swap_out")
        self._reap()
        plan = self.block_manager.swap_out(ids, hold=tier.cuda)
        self._run(plan)
        self._invalidate(ids, "swapped out")

    def swap_in(self, seq_ids: Sequence[Hashable]) -> None:
        """Bring the sequences' host pages (swapped out or cold) back to the device, all or nothing.

        Raises OutOfPages (nothing changed) when the device lacks pages. On
        CUDA the next step that names a sequence waits for its copies.
        """
        ids = seq_id_list(seq_ids, "swap_in")
        self._tier("swap_in")
        plan = self._retry(lambda: self.block_manager.swap_in(ids))
        if plan.to_device:
            self._handing_out_pages(f"sequence {ids[0]!r} was swapped in")
        ev = self._run(plan)
        for sid in ids:
            if ev is not None:
                self._arrivals[sid] = ev
        self._invalidate(ids, "swapped in")

    def make_cold(self, seq_id: Hashable, num_pages: int) -> None:
        """Keep the sequence's first ``num_pages`` pages (its oldest, full compressed pages) on the host.

        Steps of the sequence stage them into the device ring before each
        layer's attention reads them, so results do not change. Raises
        OutOfPages if the host tier lacks room.
        """
        tier = self._tier("make_cold")
        self._reap()
        plan = self.block_manager.make_cold(seq_id, num_pages, hold=tier.cuda)
        self._run(plan)
        self._invalidate([seq_id], "given cold pages")

    def _tier(self, what: str):
        if self.host_tier is None:
            raise KvgenRuntimeError(f"{what} needs a host tier; load(..., host_tokens=N) to give the cache one")
        return self.host_tier

    def _run(self, plan: TransferPlan):
        """Execute a transfer plan; on CUDA remember the device pages it holds until its event."""
        if self.host_tier is None or not plan:
            return None
        ev = self.host_tier.run(plan)
        if plan.ticket is not None:
            if ev is None:
                self.block_manager.release_held(plan.ticket)
            else:
                self._held.append((ev, plan.ticket))
        return ev

    def _reap(self, wait: bool = False) -> None:
        """Hand out again the device pages whose copies to the host have finished (all of them: ``wait``).

        Tensor-parallel ranks must make identical page decisions, and when a
        copy finishes differs between ranks: with ``tp_size > 1`` every held
        page is released at each call (waiting for its copy), never by timing.
        """
        wait = wait or self.tp_size > 1
        keep = []
        for ev, ticket in self._held:
            if wait or ev.query():
                if wait:
                    ev.synchronize()
                self.block_manager.release_held(ticket)
            else:
                keep.append((ev, ticket))
        self._held = keep

    def _retry(self, call):
        """``call()``; on OutOfPages while pages are held by copies in flight, wait for them and retry once."""
        try:
            return call()
        except OutOfPages:
            if not self._held:
                raise
        self._reap(wait=True)
        return call()

    def _handing_out_pages(self, why: str) -> None:
        """Device pages are being handed out outside plan_step (a swap-in, a prefix restore).

        A planned step releases the residual pages its conversions read when
        it is planned (they return to the free list then), but its layers
        read them later: such a step, not yet written in every layer, can no
        longer run -- the pages may be the ones handed out now. (The engine
        swaps before it plans, so it never meets this.)
        """
        step = self.step
        if step is not None and step.stale is None and step.num_conversions and \
                len(step.written) < self.num_layers:
            step.stale = (f"{why} after this step was planned, into pages the step's conversions may still read "
                          f"(plan_step released them)")

    def _invalidate(self, seq_ids: Sequence[Hashable], why: str) -> None:
        step = self.step
        if step is not None and step.stale is None:
            hit = [s for s in seq_ids if s in step.seq_ids]
            if hit:
                step.stale = f"sequence {hit[0]!r} was {why} after this step was planned"

    def _await(self, seq_id: Hashable) -> None:
        ev = self._arrivals.pop(seq_id, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _reserve_tiered(self, seq_ids: tuple, num_new: tuple, token_ids):
        """reserve_step with a host tier: ring room checked first, evicted prefix pages spilled, copies awaited."""
        bm = self.block_manager
        self.host_tier.stage_layer_one_ahead()  # first thing: the copy runs while this step is planned
        self._reap()
        for sid in seq_ids:
            bm._live(sid)  # a swapped-out sequence: SwappedOut before anything else
        cold = cold_pages(bm, seq_ids)
        if cold > self.page_pool.staging_pages:
            raise OutOfPages(
                f"this step's sequences hold {cold} cold page(s) and the staging ring holds "
                f"{self.page_pool.staging_pages}; step fewer of them at once, swap_in some, or load with "
                f"more staging_tokens")
        reservation = self._retry(lambda: bm.reserve_step(seq_ids, num_new, token_ids))
        if reservation.spills:  # evicted pages the step rewrites: copied to the host first
            ev = self._run(TransferPlan(to_host=reservation.spills))
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
        if self._arrivals:
            for sid in seq_ids:
                self._await(sid)
        return reservation

    def _stage_first(self, cold) -> None:
        """A new step's cold pages are known: start copying its layers 0 and 1 (both ring slots; the tier skips
        what a previous step staged ahead) while plan_step packs the rest. The slots' last readers, the
        previous step's last layers, are already queued."""
        for layer in range(min(2, self.num_layers)):
            self.host_tier.stage(layer, cold.runs)

    def _attention(self, step: StepMetadata, layer: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The pools and block table a kernel reads for ``layer``: with cold pages, staged first."""
        cold = step.cold
        if cold is None:
            return self.pools[layer], step.block_tables
        tier = self.host_tier
        tier.ensure(layer, cold.runs)
        if layer + 1 < self.num_layers:
            tier.stage(layer + 1, cold.runs)  # one layer ahead, overlapping this layer's attention
        elif layer % 2 == 1:
            # The last layer reads slot 1 and slot 0's last reader is queued: a next step's layer 0 goes there
            # now (a decode step's cold pages are its predecessor's). With an odd layer count the last layer
            # itself reads slot 0, whose kernel is not queued yet: no staging ahead then.
            tier.stage(0, cold.runs)
        return self.page_pool.attention_view(layer), cold.tables[layer]

    def _gather_pages(self, layer: int, seq_id: Hashable, table: list[int], nc: int) -> dict[str, torch.Tensor]:
        """A pool holding the sequence's pages of ``layer`` in logical order (compressed, then residual)."""
        host = self.host_tier.pool.tensors
        on_host = self.block_manager.host_pages(seq_id)
        out: dict[str, torch.Tensor] = {}
        for pool, pages in ((COMPRESSED, range(nc)), (RESIDUAL, range(nc, len(table)))):
            if not pages:
                continue
            for name, dev in self.page_pool.named(layer, pool).items():
                rows = [(host[pool][name][layer][table[i]] if i < on_host else dev[table[i]]).to(self.device)
                        for i in pages]
                out[name] = torch.stack(rows)
        return out
