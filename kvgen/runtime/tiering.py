"""Host-tier page accounting of the :class:`~.block_manager.BlockManager`: swap, cold pages, prefix spill.

The host tier is two more pools of the manager, in the device pools' page
format: ``host_compressed`` (the scheme's pages) and ``host_residual`` (a
residual scheme's compute-dtype tail pages). Page ids are per pool, as on the
device. A block-table entry is a host page id when the sequence is swapped
out, or when it is one of the sequence's ``cold`` leading pages::

    logical page     0    1    2    3    4         (cold = 2: the oldest pages live on the host)
                  [ h5 | h6 | c3 | c9 | c1 ]
                   host_compressed   device

The manager only decides; every decision that moves data comes back as a
:class:`TransferPlan` which the caller executes (``to_host`` first, then
``to_device``), as with :class:`~.block_manager.AppendPlan`.

Sharing rule: a page referenced by several sequences is copied once per
call. ``swap_out([a, b])`` of two forks sharing a prefix makes one host copy
of each shared page, referenced by both; ``swap_in([a, b])`` brings it back
into one device page, shared again. Across separate calls each call makes its
own copy (correct, it only costs memory): a page shared with a sequence that
stays on the device keeps its device copy for that sequence. A swapped-in
compressed page whose prefix hash the device prefix cache still holds is not
copied at all: the cached device page is reused.

Cold pages are full compressed pages only (never a tail page a step may
write, never a residual page a step may convert), so steps of a sequence
with cold pages change nothing on the host; the cache stages cold pages into
a device ring before attention reads them.

Prefix spill: when an allocation evicts a page from the device prefix cache
and a host tier exists, the page is copied into a free (or the least
recently spilled) host page and stays findable under its hash there;
``add_sequence_plan`` restores it into a free device page on a later hit.
Spilling is best effort: with the host tier full of swapped pages the page is
dropped, as without a host tier.

Asynchronous copies (CUDA): a device page that a ``to_host`` copy still
reads must not be handed out before the copy ran. With ``hold=True`` the
pages that ``swap_out``/``make_cold`` release are held under
``plan.ticket`` until :meth:`TieringMixin.release_held`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .errors import KvgenRuntimeError, OutOfPages, seq_id_list

HOST_COMPRESSED = "host_compressed"
"""Name of the host tier's pool of compressed pages."""
HOST_RESIDUAL = "host_residual"
"""Name of the host tier's pool of residual (compute dtype) pages."""
HOST = {"compressed": HOST_COMPRESSED, "residual": HOST_RESIDUAL}
"""Device pool name -> the host pool holding the same page format."""


@dataclass(frozen=True)
class TransferPlan:
    """Copies between the tiers the caller must run: all of ``to_host``, then all of ``to_device``.

    ``to_host``: ``(pool, device page, host page)``; ``to_device``:
    ``(pool, host page, device page)``; ``pool`` is the device pool name
    (``"compressed"``/``"residual"``), the host page is in :data:`HOST`\\ [pool].
    ``ticket``: when not None, the device pages released by this call stay
    out of reach until ``release_held(ticket)`` (after ``to_host`` ran).
    """

    to_host: list[tuple[str, int, int]] = field(default_factory=list)
    to_device: list[tuple[str, int, int]] = field(default_factory=list)
    ticket: int | None = None

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.ticket is not None)


class TieringMixin:
    """The host-tier operations of BlockManager (it provides the books: pools, caches, sequences)."""

    # -- queries ------------------------------------------------------------
    def host_pages(self, seq_id: Hashable) -> int:
        """How many leading logical pages of the sequence are in the host tier (all when swapped out)."""
        s = self._seq(seq_id)
        return len(s.table) if s.swapped else s.cold

    def is_swapped(self, seq_id: Hashable) -> bool:
        """True while the sequence is swapped out (no step may name it)."""
        return self._seq(seq_id).swapped

    def num_held_pages(self) -> int:
        """Device pages held until an asynchronous copy to the host has read them."""
        return len(self._held_set)

    # -- mutations ----------------------------------------------------------
    def swap_out(self, seq_ids: Sequence[Hashable], hold: bool = False) -> TransferPlan:
        """Move every device page of the sequences to the host tier, all or nothing.

        Raises OutOfPages (nothing changed) when the host pools lack room,
        counting spilled prefix pages as evictable. The sequences then keep
        their length and tokens but may not be stepped until :meth:`swap_in`.
        Their device pages return to the free list (or the prefix cache's LRU
        list), or with ``hold=True`` are held under ``plan.ticket``.
        """
        ids, seqs = self._tier_args(seq_ids, "swap_out")
        for sid, s in zip(ids, seqs):
            if s.swapped:
                raise KvgenRuntimeError(f"sequence {sid!r} is already swapped out; swap_in it or free it")
        # (pool, device page) of every device page, each once: (a swap of 100K tokens is 6,250 pages, and
        # this host work delays the copies, so the loops below stay lean)
        keys = list(dict.fromkeys(key for s in seqs for key in self._device_keys(s)))
        for base in ("compressed", "residual"):
            self._check_room(HOST[base], sum(1 for k in keys if k[0] == base), f"swapping out {list(ids)[:4]}")
        self._parked = []
        try:
            # Host pages are taken head first (ascending ids on a fresh pool, like the device pages of a
            # sequence that was filled at once) so both sides form the same runs and the host tier copies
            # whole runs on the copy engine instead of gathering pages with a kernel that competes with
            # decode; device pages are released tail first, as free() releases.
            alloc, release = self._alloc, self._release
            moves = {key: alloc(HOST[key[0]]) for key in keys}
            placed: set = set()
            for s in seqs:
                table = s.table
                for i, key in reversed(list(enumerate(self._device_keys(s), s.cold))):
                    hp = moves[key]
                    if key in placed:
                        self._pools[HOST[key[0]]].ref[hp] += 1
                    else:
                        placed.add(key)
                    table[i] = hp
                    release(*key)
                s.swapped = True
            parked = self._parked
        finally:
            self._parked = None
        return TransferPlan(to_host=[(b, d, h) for (b, d), h in moves.items()],
                            ticket=self._settle(parked, hold, list(moves)))

    def make_cold(self, seq_id: Hashable, num_pages: int, hold: bool = False) -> TransferPlan:
        """Keep the sequence's first ``num_pages`` pages in the host tier (its oldest tokens).

        ``num_pages`` is at most the sequence's full compressed pages. Pages
        already cold stay; a smaller ``num_pages`` changes nothing (use
        :meth:`swap_in` to bring cold pages back). Raises OutOfPages (nothing
        changed) when the host tier lacks room.
        """
        s = self._live(seq_id)
        limit = min(s.num_compressed, s.length // self.page_size)
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or not 0 <= num_pages <= limit:
            raise KvgenRuntimeError(
                f"make_cold({seq_id!r}) takes 0..{limit} pages (its full compressed pages), got {num_pages!r}")
        if num_pages <= s.cold:
            return TransferPlan()
        self._check_room(HOST_COMPRESSED, num_pages - s.cold, f"making pages of {seq_id!r} cold")
        to_host = []
        self._parked = []
        try:
            for i in range(s.cold, num_pages):
                dev = s.table[i]
                hp = self._alloc(HOST_COMPRESSED)
                s.table[i] = hp
                self._release("compressed", dev)
                to_host.append(("compressed", dev, hp))
            s.cold = num_pages
            parked = self._parked
        finally:
            self._parked = None
        return TransferPlan(to_host=to_host, ticket=self._settle(parked, hold, [(p, d) for p, d, _ in to_host]))

    def swap_in(self, seq_ids: Sequence[Hashable]) -> TransferPlan:
        """Bring every host page of the sequences (swapped out, or cold) back to the device, all or nothing.

        Raises OutOfPages (nothing changed) when the device pools lack room
        (evictable prefix-cache pages count as room; evicting them may spill
        them to the host: those copies are in ``plan.to_host``).
        """
        ids, seqs = self._tier_args(seq_ids, "swap_in")
        actions: dict[tuple[str, int], int | str | None] = {}  # (pool, host page) -> reused device page or None
        hashes: dict[tuple[str, int], str | None] = {}
        need = {"compressed": 0, "residual": 0}
        revived: set[int] = set()
        hash_page, cref = self._hash_page, self._pools["compressed"].ref
        host_keys = [self._host_keys(s) for s in seqs]
        for s, keys in zip(seqs, host_keys):
            nh = len(s.hashes)
            for i, key in enumerate(keys):
                if key in actions:
                    continue
                h = s.hashes[i] if i < nh and key[0] == "compressed" else None
                dev = hash_page.get(h) if h is not None else None
                actions[key], hashes[key] = dev, h
                if dev is None:
                    need[key[0]] += 1
                elif cref[dev] == 0 and dev in self._lru:
                    revived.add(dev)
        avail = {"compressed": len(self._pools["compressed"].free) + len(self._lru) - len(revived),
                 "residual": len(self._pools["residual"].free)}
        for base, n in need.items():
            if n > avail[base]:
                raise OutOfPages(
                    f"the {base} pool is out of pages: swapping in {list(ids)[:4]} needs {n} page(s), "
                    f"{avail[base]} free or evictable; free (preempt) a sequence and retry")
        # -- from here on nothing can fail --
        for key, dev in actions.items():
            if dev is not None:
                self._acquire_cached(dev)
        to_device = []
        for key, dev in actions.items():
            if dev is None:
                dev = actions[key] = self._alloc(key[0])
                if hashes[key] is not None:
                    self._register(dev, hashes[key])
                to_device.append((key[0], key[1], dev))
        placed: set = set()
        release = self._release
        for s, keys in zip(seqs, host_keys):
            table = s.table
            for i, key in enumerate(keys):
                dev = actions[key]
                if key in placed:
                    self._pools[key[0]].ref[dev] += 1
                else:
                    placed.add(key)
                table[i] = dev
                release(HOST[key[0]], key[1])
            s.swapped, s.cold = False, 0
        spills, self._spills = self._spills, []
        return TransferPlan(to_host=spills, to_device=to_device)

    def release_held(self, ticket: int) -> None:
        """The copies of ``ticket``'s plan have read their device pages: hand out those no other copy holds."""
        for key in self._held.pop(ticket, ()):
            if self._held_set[key] > 1:  # another swap's copy still reads it
                self._held_set[key] -= 1
                continue
            del self._held_set[key]
            pool, page = key
            if self._pools[pool].ref[page] == 0:  # not referenced again (a fork, a prefix hit) meanwhile
                self._drop(pool, page)

    # -- internals ----------------------------------------------------------
    @staticmethod
    def _host_keys(s) -> list[tuple[str, int]]:
        """``(device pool, host page)`` of the sequence's host pages (all when swapped out), in logical order."""
        nc, table = s.num_compressed, s.table
        return [("compressed" if i < nc else "residual", table[i])
                for i in range(len(table) if s.swapped else s.cold)]

    @staticmethod
    def _device_keys(s) -> list[tuple[str, int]]:
        """``(pool, page)`` of the sequence's device pages past its cold ones, in logical order."""
        nc, table = s.num_compressed, s.table
        return [("compressed" if i < nc else "residual", table[i]) for i in range(s.cold, len(table))]

    def _tier_args(self, seq_ids: Sequence[Hashable], what: str) -> tuple[tuple, list]:
        ids = seq_id_list(seq_ids, what)
        if len(set(ids)) != len(ids):
            raise KvgenRuntimeError(f"{what} got a sequence id twice; name each sequence once")
        return ids, [self._seq(sid) for sid in ids]

    def _check_room(self, pool: str, need: int, what: str) -> None:
        if need == 0:
            return
        if self._pools[pool].size == 0:
            raise KvgenRuntimeError(
                f"{what} needs the host tier, and this cache has none ({pool} has no pages); "
                f"load(..., host_tokens=N) to give it one")
        avail = self.num_free_pages(pool)
        if need > avail:
            raise OutOfPages(
                f"the host tier's {pool} pool is out of pages: {what} needs {need} page(s), {avail} free or "
                f"evictable; swap in or free a swapped-out sequence, or load with more host_tokens")

    def _settle(self, parked: list, hold: bool, read: list) -> int | None:
        """Device pages a swap released (``parked``) and read (``read``): with ``hold``, hold them all under a
        new ticket; else drop the released ones now.

        Pages the copies read but other sequences still reference (a fork's
        shared pages) are held too: if those sequences free them before the
        copies ran, they must not be handed out (and rewritten) yet.
        """
        if not hold:
            for pool, page in parked:
                self._drop(pool, page)
            return None
        self._tickets += 1
        pages = list(dict.fromkeys([*parked, *read]))
        self._held[self._tickets] = pages
        self._held_set.update(pages)
        return self._tickets

    def _spill(self, page: int, h: str) -> None:
        """Device prefix page ``page`` (hash ``h``) is being evicted: keep a copy in the host tier."""
        host = self._caches[HOST_COMPRESSED]
        pool = self._pools[HOST_COMPRESSED]
        if h in host.hash_page or not (pool.free or host.lru):
            return  # already on the host, or no room (best effort)
        if not pool.free and next(iter(host.lru)) in self._protect:
            return  # would overwrite a page a restore in progress reads
        hp = self._alloc(HOST_COMPRESSED)  # may evict the least recently spilled page
        self._register(hp, h, HOST_COMPRESSED)
        self._set_ref(HOST_COMPRESSED, hp, 0)
        self._drop(HOST_COMPRESSED, hp)  # registered: onto the host LRU list
        self._spills.append(("compressed", page, hp))
        if self._journal is not None:
            from .journal import SPILL
            self._journal.append((SPILL,))

    def _touch_host(self, h: str) -> None:
        """A spilled page was restored: it becomes the most recently used host page."""
        host = self._caches[HOST_COMPRESSED]
        hp = host.hash_page[h]
        if hp in host.lru:
            del host.lru[hp]
            host.lru[hp] = self._stamp
            self._stamp += 1
