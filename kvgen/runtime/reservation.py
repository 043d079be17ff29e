"""Slot reservation of the :class:`~.block_manager.BlockManager`: ``append`` and ``reserve_step``.

An append is worked out first and carried out second. ``_prepare`` computes
everything it will do (copy-on-write of a shared tail page, new pages, pages
leaving the residual window, prefix hashes of the pages that fill up) as a
``_Draft`` and checks the pools can serve it, mutating nothing; so
:class:`~.errors.OutOfPages` leaves every structure as it was. ``_append``
then carries the draft out through the manager's journaled helpers
(``_alloc``, ``_release``, ``_register``, ...), which cannot fail, and returns
the :class:`~.pages.AppendPlan`.

One model step, one reservation: :meth:`ReservationMixin.reserve_step`
appends for every sequence of a step at once, all or nothing (an undo
journal, :mod:`.journal`, of what changed rolls back any failure, at a cost
proportional to the step's own changes, never to the pool). A page whose last
reference goes away *during* the step (a converted residual page, a shared
page a prefix hit replaced) is parked, not freed, until the step ends: the
step's kernels run "copies, writes, conversions" per layer, so a page still to
be read by a conversion must not be handed out to a write of the same step. A
long residual-scheme append that runs out of free residual pages releases the
parked pages and opens a new :class:`~.pages.Phase`; per layer, phases run in
order, so the new phase's writes land after the earlier conversions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from . import journal as J
from .errors import KvgenRuntimeError, OutOfPages, append_tokens, seq_id_list, step_args
from .pages import COMPRESSED, RESIDUAL, AppendPlan, Phase, StepPlan, _Draft, _Seq, page_hash


class ReservationMixin:
    """The append operations of BlockManager (it provides the books and the journaled helpers that change them)."""

    _decode_fast_path = True  # reserve_step's shortcut for a token inside its own tail page (tests turn it off)

    # -- queries ------------------------------------------------------------
    def can_append(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """True when :meth:`append` with these arguments would not raise OutOfPages."""
        try:
            self._prepare(seq_id, self._live(seq_id), num_tokens, append_tokens(token_ids, num_tokens))
        except OutOfPages:
            return False
        return True

    # -- mutations ----------------------------------------------------------
    def append(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> AppendPlan:
        """Reserve slots for ``num_tokens`` new tokens of the sequence; see :class:`AppendPlan`.

        Allocates the pages the tokens need, copies the tail page first if it
        is shared, converts pages that leave the residual window, and returns
        what the caller must do. ``token_ids`` (``num_tokens`` ids) lets the
        pages that fill up be registered in the prefix cache; once an append
        of a sequence omits them, none of its later pages is cached. For the
        appends of a whole model step use :meth:`reserve_step`.

        Atomic: raises :class:`OutOfPages` (after counting evictable cached
        pages as available) with no state changed. Raises UnknownSequence for
        an id that is not live.
        """
        s = self._live(seq_id)
        plan = self._append(seq_id, s, num_tokens, append_tokens(token_ids, num_tokens))
        if self._spills:
            spills, self._spills = self._spills, []
            plan = AppendPlan(plan.slots, plan.copies, plan.conversions, plan.write_pool, spills)
        return plan

    def reserve_step(self, seq_ids: Sequence[Hashable], num_new: Sequence[int],
                     token_ids: Sequence[Sequence[int] | None] | None = None) -> StepPlan:
        """Append ``num_new[b]`` tokens to every sequence ``seq_ids[b]`` of one model step, all or nothing.

        ``token_ids``: None, or per sequence the ids of its new tokens (or
        None), so that full pages enter the prefix cache. Returns the
        :class:`StepPlan`: per phase, the copies to run, then the write of its
        tokens, then the conversions (see :class:`Phase`). Pages released
        during the step are parked and return to the free list (or the LRU
        list) when the step ends, or at a phase boundary; so no write or copy
        of a phase lands in a page that a copy or conversion of the same phase
        still has to read. For a residual scheme an append that does not fit
        the free residual pages (a long prompt) is cut into chunks, and the
        next chunk, in a new phase, reuses the pages the earlier conversions
        released.

        Raises :class:`OutOfPages`, :class:`UnknownSequence` or another
        KvgenRuntimeError (bad arguments) with every structure exactly as
        before: an undo journal rolls back what the step changed.
        """
        seq_ids = seq_id_list(seq_ids, "reserve_step")
        counts, toks = step_args(seq_ids, num_new, token_ids)
        seqs = [self._live(sid) for sid in seq_ids]
        journal: list = []
        self._journal, self._parked, stamp = journal, [], self._stamp
        P, W = self.page_size, self.write_pool
        ref = self._pools[W].ref
        # residual schemes convert pages as they leave the window: always planned
        fast = self._window is None and self._decode_fast_path
        try:
            slots: list[int] = []
            phases = [Phase(0)]
            for sid, s, n, tk in zip(seq_ids, seqs, counts, toks):
                n0 = s.length
                hashing = s.known and tk is not None
                if (fast and n == 1 and n0 % P and (n0 + 1) % P and ref[s.table[n0 // P]] == 1
                        and not (hashing and len(s.pending) + 1 >= P)):
                    # A decode token landing inside its own, unshared tail page that it does not fill: no page,
                    # copy, conversion or hash -- _append's outcome without its draft (most decode tokens;
                    # the general path is ~10x the host time, 32 sequences a step).
                    journal.append((J.SEQ, s, n0, s.num_compressed, len(s.hashes), s.pending, s.known))
                    slots.append(s.table[n0 // P] * P + n0 % P)
                    s.length = n0 + 1  # num_compressed (ceil(length / P) without a residual pool) stays
                    if hashing:
                        s.pending = s.pending + tk  # a new list: the journal holds the old one
                    else:
                        s.pending, s.known = [], False
                    continue
                done = 0
                while done < n:
                    chunk = n - done
                    if self._window is not None:
                        chunk = self._fit(s, chunk)
                        if chunk == 0:
                            if not self._parked:
                                raise self._out_of_pages(RESIDUAL, sid, n - done, 1, 0)
                            self._unpark()  # later writes run after this phase's conversions
                            phases[-1].end = len(slots)
                            phases.append(Phase(len(slots)))
                            continue
                    plan = self._append(sid, s, chunk, None if tk is None else tk[done:done + chunk])
                    slots.extend(plan.slots)
                    phases[-1].copies.extend(plan.copies)
                    phases[-1].conversions.extend(plan.conversions)
                    done += chunk
            phases[-1].end = len(slots)
            self._unpark()
        except OutOfPages as e:
            J.rollback(self, journal, stamp)
            raise OutOfPages(f"this step of {len(seq_ids)} sequence(s): {e}") from None
        except BaseException:
            J.rollback(self, journal, stamp)
            raise
        finally:
            self._journal = self._parked = None
        spills, self._spills = self._spills, []
        return StepPlan(slots, phases, spills)

    # -- internals ----------------------------------------------------------
    def _fit(self, s: _Seq, want: int) -> int:
        """How many of ``want`` tokens one residual append can place in the free residual pages now."""
        P = self.page_size
        n0 = s.length
        free = len(self._pools[RESIDUAL].free)
        if n0 % P and self._pools[RESIDUAL].ref[s.table[n0 // P]] > 1:
            free -= 1  # the shared tail page is copied first
            if free < 0:
                return 0
        room = (-(-n0 // P) + free) * P - n0  # the tail page's free slots plus whole free pages
        return min(want, room)

    def _append(self, seq_id: Hashable, s: _Seq, num_tokens: int, tokens: list[int] | None) -> AppendPlan:
        d = self._prepare(seq_id, s, num_tokens, tokens)
        # -- from here on nothing can fail --
        P = self.page_size
        W = self.write_pool
        j = self._journal
        if j is not None:
            j.append((J.SEQ, s, s.length, s.num_compressed, len(s.hashes), s.pending, s.known))
        copies: list[tuple[str, int, int]] = []
        if d.cow:
            idx = s.length // P
            src = s.table[idx]
            dst = self._alloc(W)
            self._set_ref(W, src, self._pools[W].ref[src] - 1)  # was > 1, so the page stays referenced
            self._set_table(s, idx, dst)
            copies.append((W, src, dst))
        for _ in range(d.new_pages):
            s.table.append(self._alloc(W))
            if j is not None:
                j.append((J.TABLE_APPEND, s))
        slots = [s.table[t // P] * P + t % P for t in range(s.length, s.length + num_tokens)]

        conversions: list[tuple[int, int]] = []
        # Take reused cached pages off the LRU list before allocating, so the
        # allocations below cannot evict them.
        for _, _, cached in d.convert:
            if cached is not None:
                self._acquire_cached(cached)
        for i, h, cached in d.convert:
            src = s.table[i]
            if cached is None:
                dst = self._alloc(COMPRESSED)
                conversions.append((src, dst))
                if h is not None:
                    self._register(dst, h)
            else:
                dst = cached  # same prefix already compressed: share it, skip the work
            self._set_table(s, i, dst)
            self._release(RESIDUAL, src)
        for i, h in d.register:
            self._register(s.table[i], h)

        s.length += num_tokens
        s.num_compressed = d.num_compressed
        s.hashes.extend(d.new_hashes)
        s.pending = d.pending
        s.known = d.known
        return AppendPlan(slots, copies, conversions, W)

    def _prepare(self, seq_id: Hashable, s: _Seq, num_tokens: int, tokens: list[int] | None) -> _Draft:
        """Work out an append and check the pools can serve it; mutates nothing."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise KvgenRuntimeError(f"append num_tokens must be an int >= 0, got {num_tokens!r}")
        P = self.page_size
        n0, n1 = s.length, s.length + num_tokens
        W = self.write_pool
        cow = num_tokens > 0 and n0 % P != 0 and self._pools[W].ref[s.table[n0 // P]] > 1
        new_pages = -(-n1 // P) - -(-n0 // P)

        new_hashes: list[str] = []
        if num_tokens == 0:
            pending, known = s.pending, s.known
        elif s.known and tokens is not None:
            toks = s.pending + tokens
            parent = s.hashes[-1] if s.hashes else None
            full = len(toks) // P
            for i in range(full):
                parent = page_hash(parent, toks[i * P:(i + 1) * P], self.scheme_name)
                new_hashes.append(parent)
            pending, known = toks[full * P:], True
        else:
            pending, known = [], False
        # s.hashes + new_hashes without copying s.hashes (O(pages) per decode token otherwise)
        old_h = s.hashes
        n_old = len(old_h)
        n_hashes = n_old + len(new_hashes)

        def hash_at(i: int) -> str:
            return old_h[i] if i < n_old else new_hashes[i - n_old]

        convert: list[tuple[int, str | None, int | None]] = []
        register: list[tuple[int, str]] = []
        need_c = 0
        revived = 0
        if self._window is None:
            num_compressed = -(-n1 // P)
            register = [(i, hash_at(i)) for i in range(n0 // P, min(n1 // P, n_hashes))]
            need_w = int(cow) + new_pages
            avail_w = len(self._pools[W].free) + len(self._lru)
        else:
            num_compressed = max(s.num_compressed, self.compressed_pages(n1))
            for i in range(s.num_compressed, num_compressed):
                h = hash_at(i) if i < n_hashes else None
                cached = self._hash_page.get(h) if h is not None else None
                if cached is None:
                    need_c += 1
                elif self._pools[COMPRESSED].ref[cached] == 0 and cached in self._lru:
                    revived += 1
                convert.append((i, h, cached))
            need_w = int(cow) + new_pages
            avail_w = len(self._pools[W].free)
        if need_w > avail_w:
            raise self._out_of_pages(W, seq_id, num_tokens, need_w, avail_w)
        avail_c = len(self._pools[COMPRESSED].free) + len(self._lru) - revived
        if need_c > avail_c:
            raise self._out_of_pages(COMPRESSED, seq_id, num_tokens, need_c, avail_c)
        return _Draft(cow, new_pages, new_hashes, pending, known, num_compressed, convert, register)

    def _out_of_pages(self, pool: str, seq_id: Hashable, num_tokens: int, need: int, avail: int) -> OutOfPages:
        return OutOfPages(
            f"the {pool} pool is out of pages: appending {num_tokens} token(s) to sequence {seq_id!r} "
            f"needs {need} page(s), {avail} free or evictable; free (preempt) a sequence and retry, "
            f"or give the cache more pages")
