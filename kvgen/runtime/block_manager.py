"""Page accounting for a paged KV cache: the BlockManager, its books (free lists, ref counts, prefix cache).

The :class:`BlockManager` owns no tensors. It decides which page of which pool
every token of every sequence lives in, and tells the caller, as an
:class:`AppendPlan`, which page copies, token writes and page conversions to
perform. It is pure Python and deterministic: two managers given the same
calls make the same decisions (tensor-parallel ranks rely on that), so it
iterates no sets and hashes prefixes with sha256, not Python's salted hash.

Two pools, two id spaces::

    compressed pool  ids 0 .. num_compressed_pages-1   (the scheme's quantized pages)
    residual pool    ids 0 .. num_residual_pages-1     (compute dtype, k and v)

A sequence of ``n`` tokens has ``ceil(n / page_size)`` logical pages. With
``residual_tokens=None`` every page is compressed (tokens are quantized as
they are written). With ``residual_tokens=R`` the last, partly filled page
and the ``R // page_size`` most recent full pages are residual; older full
pages are converted into the compressed pool::

    logical page   0    1    2    3    4    5        (page_size 4, n = 22, R = 8)
                 [ c7 | c2 | c9 | r0 | r4 | r1 ]
                  compressed      residual
                  num_compressed = max(0, 22 // 4 - 8 // 4) = 3

``block_table(seq)[i]`` is a page id in the compressed pool for
``i < num_compressed(seq)`` and in the residual pool otherwise.

Prefix cache: a full page in its final pool whose token ids are known is
registered under a chain hash ``sha256(repr((parent_hash, token_ids,
scheme_name)))``; a new sequence whose prompt starts with the same tokens
reuses it. For residual schemes only compressed pages are final, so only they
are cached. A cached page whose last reference goes away is kept on an LRU
list, still findable, and is evicted only when an allocation finds the free
list empty.

Appends: :meth:`~.reservation.ReservationMixin.append` for one sequence,
:meth:`~.reservation.ReservationMixin.reserve_step` for every sequence of a
model step at once, all or nothing, with the pages a step releases parked
until it ends. They live in :mod:`.reservation`; the journaled helpers every
mutation goes through (``_alloc``, ``_release``, ``_register``, ...) stay
here, with the books they change.

Host tier (optional, ``num_host_pages``): two more pools, ``host_compressed``
and ``host_residual``, in the same page format; whole sequences swap out and
in, a sequence's oldest compressed pages can live there ("cold" pages), and
prefix-cache pages the LRU evicts spill there. Those operations live in
:mod:`.tiering`; the books stay here, one owner for every tier.

The manager is not thread-safe; call it from one thread (the scheduler's).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

from . import journal as J
from .pages import COMPRESSED, RESIDUAL, AppendPlan, Phase, StepPlan, _Pool, _PrefixCache, _Seq, page_hash
from .errors import KvgenRuntimeError, SwappedOut, UnknownSequence, check_seq_id, token_list
from .reservation import ReservationMixin
from .tiering import HOST, HOST_COMPRESSED, HOST_RESIDUAL, TieringMixin, TransferPlan

POOLS = (COMPRESSED, RESIDUAL)
__all__ = ["COMPRESSED", "RESIDUAL", "HOST_COMPRESSED", "HOST_RESIDUAL", "HOST", "POOLS", "AppendPlan", "Phase",
           "StepPlan", "TransferPlan", "BlockManager", "page_hash"]


class BlockManager(ReservationMixin, TieringMixin):
    """Allocates pages of a two-pool paged KV cache to sequences.

    ``BlockManager(page_size, num_compressed_pages, num_residual_pages,
    residual_tokens, scheme_name="", num_host_pages=0, num_host_residual_pages=0)``
    (host tier sizes, see :mod:`.tiering`): ``residual_tokens`` is the scheme's
    (None: no residual pool is used; ``R >= 0``: the tail page and ``R //
    page_size`` recent full pages are residual). ``scheme_name`` goes into the
    prefix hashes so two schemes never share pages.

    Guarantees:

    - allocate and free are O(1) (a LIFO free list per pool); each page is, at
      any time, exactly one of: referenced by block tables (its ref count is
      the number of references), on the free list, cached-and-evictable,
      (only inside :meth:`reserve_step`) parked until the step ends, or held
      until an asynchronous copy to the host has read it (see
      :meth:`release_held`);
    - a page referenced by more than one sequence is never written: the first
      append into it copies it first (copy-on-write);
    - within one :meth:`reserve_step`, no page that a copy or conversion of a
      phase reads is handed out to a write of the same phase;
    - any call that raises leaves every structure exactly as it was; in
      particular :class:`OutOfPages` can be caught to preempt and retry;
    - identical call sequences give identical decisions on every process.
    """

    def __init__(self, page_size: int, num_compressed_pages: int, num_residual_pages: int,
                 residual_tokens: int | None, scheme_name: str = "", num_host_pages: int = 0,
                 num_host_residual_pages: int = 0) -> None:
        for name, value, low in (("page_size", page_size, 1),
                                 ("num_compressed_pages", num_compressed_pages, 0),
                                 ("num_residual_pages", num_residual_pages, 0),
                                 ("num_host_pages", num_host_pages, 0),
                                 ("num_host_residual_pages", num_host_residual_pages, 0)):
            # page ids live in C int arrays (block tables) and int32 device tables
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 2**31 - 1:
                raise KvgenRuntimeError(f"BlockManager {name} must be an int from {low} to 2**31 - 1, got {value!r}")
        if residual_tokens is not None and (not isinstance(residual_tokens, int) or residual_tokens < 0):
            raise KvgenRuntimeError(
                f"BlockManager residual_tokens must be None or an int >= 0, got {residual_tokens!r}")
        self.page_size = page_size
        self.residual_tokens = residual_tokens
        self.scheme_name = scheme_name
        self.write_pool = COMPRESSED if residual_tokens is None else RESIDUAL
        self._window = None if residual_tokens is None else residual_tokens // page_size
        self._pools = {COMPRESSED: _Pool.new(num_compressed_pages), RESIDUAL: _Pool.new(num_residual_pages),
                       HOST_COMPRESSED: _Pool.new(num_host_pages),
                       HOST_RESIDUAL: _Pool.new(num_host_residual_pages)}
        # Prefix caches (compressed pages only; the host one holds spilled pages): hash <-> page,
        # and the evictable cached pages (ref count 0) -> the stamp of their release, least
        # recently released first (stamps ascend along the list, so an undo can put a revived
        # page back in its place).
        self._caches = {COMPRESSED: _PrefixCache(), HOST_COMPRESSED: _PrefixCache()}
        c = self._caches[COMPRESSED]
        self._hash_page, self._page_hash = c.hash_page, c.page_hash
        self._stamp = 0
        self._seqs: dict[Hashable, _Seq] = {}
        # Only inside reserve_step: the undo journal and the pages parked until the step ends.
        self._journal: list | None = None
        self._parked: list[tuple[str, int]] | None = None
        # Copies of evicted prefix pages to the host the current call decided (see AppendPlan.spills);
        # empty between calls.
        self._spills: list[tuple[str, int, int]] = []
        self._protect: set[int] = set()  # host pages a restore in progress reads: never spilled over
        # Device pages an asynchronous copy to the host still reads: ticket -> pages, and their set.
        self._held: dict[int, list[tuple[str, int]]] = {}
        self._held_set: Counter[tuple[str, int]] = Counter()  # held page -> tickets holding it
        self._tickets = 0

    @property
    def _lru(self) -> OrderedDict:
        """The device prefix cache's evictable pages (page -> release stamp), oldest first."""
        return self._caches[COMPRESSED].lru

    def __repr__(self) -> str:
        return (f"BlockManager(page_size={self.page_size}, residual_tokens={self.residual_tokens}, "
                f"compressed={self.num_free_pages(COMPRESSED)}/{self._pools[COMPRESSED].size} free, "
                f"residual={self.num_free_pages(RESIDUAL)}/{self._pools[RESIDUAL].size} free, "
                f"host={self.num_free_pages(HOST_COMPRESSED)}/{self._pools[HOST_COMPRESSED].size} free, "
                f"sequences={len(self._seqs)})")

    # -- queries ------------------------------------------------------------
    def compressed_pages(self, num_tokens: int) -> int:
        """How many of the first pages of an ``num_tokens``-token sequence are compressed
        when it holds no pages reused from the prefix cache (see :meth:`num_compressed`)."""
        if self._window is None:
            return -(-num_tokens // self.page_size)
        return max(0, num_tokens // self.page_size - self._window)

    def sequences(self) -> list[Hashable]:
        """Live sequence ids, in the order they were added."""
        return list(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds (cached prefix included)."""
        return self._seq(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table: logical page -> page id.

        Entries ``[0, num_compressed)`` are compressed-pool ids, the rest
        residual-pool ids; its length is ``ceil(seq_len / page_size)``.
        """
        return list(self._seq(seq_id).table)

    def step_view(self, seq_ids: Sequence[Hashable]) -> tuple[list[array], list[int], list[int]]:
        """``(tables, lengths, num_compressed)`` of ``seq_ids`` in one pass, for packing a step's metadata.

        The tables are the manager's own int arrays (``array("i")``), not copies (a step packs
        thousands of entries per decode step): read them before the next
        mutating call, never write them, never keep a buffer view of one (a
        later append would fail while the view lives). Use :meth:`block_table` for a copy.
        """
        seqs = [self._seq(sid) for sid in seq_ids]
        return [s.table for s in seqs], [s.length for s in seqs], [s.num_compressed for s in seqs]

    def num_compressed(self, seq_id: Hashable) -> int:
        """How many leading logical pages of the sequence are in the compressed pool.

        Equal to :meth:`compressed_pages` of its length, except right after a
        prefix-cache hit on a residual scheme: the reused compressed pages count
        even while the sequence is still too short for them to have been
        converted. It equals the formula again once the sequence holds every
        token passed to :meth:`add_sequence`. Kernels must read this value, not
        recompute it from the length.
        """
        return self._seq(seq_id).num_compressed

    def num_free_pages(self, pool: str) -> int:
        """Pages of ``pool`` an allocation can take: free plus evictable cached pages."""
        n = len(self._pool(pool).free)
        cache = self._caches.get(pool)
        return n + len(cache.lru) if cache is not None else n

    def ref_count(self, pool: str, page: int) -> int:
        """Number of block-table references to ``page`` of ``pool``."""
        p = self._pool(pool)
        if not isinstance(page, int) or not 0 <= page < p.size:
            raise KvgenRuntimeError(f"page {page!r} is not in the {pool} pool (ids 0..{p.size - 1})")
        return p.ref[page]

    # -- mutations ----------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = ()) -> int:
        """Register a new sequence and reuse the longest cached prefix of ``token_ids``.

        Returns how many leading tokens of ``token_ids`` already have their KV
        in the cache: a multiple of ``page_size``. The sequence starts with
        that length, sharing those pages; the caller appends only the
        remaining tokens (pass their ids to :meth:`append` so they can be
        cached in turn). Every token may hit; a caller that needs the logits
        of the last prompt token passes ``prompt[:-1]`` here. For residual
        schemes only pages that will be compressed once all of ``token_ids``
        are appended can hit. ``token_ids=None`` is the same as ``()``. Never
        allocates, so never raises OutOfPages. Raises KvgenRuntimeError if
        ``seq_id`` is already live or is not hashable, or for token ids that
        are not ints.
        """
        return self._add(seq_id, token_ids, restore=False)[0]

    def _add(self, seq_id: Hashable, token_ids: Sequence[int] | None, restore: bool) -> tuple[int, TransferPlan]:
        check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise KvgenRuntimeError(f"sequence {seq_id!r} already exists; free it first or use a new id")
        tokens = [] if token_ids is None else token_list(token_ids, f"add_sequence({seq_id!r})")
        P = self.page_size
        full = len(tokens) // P
        limit = full if self._window is None else max(0, full - self._window)
        pages: list[int] = []
        hashes: list[str] = []
        restores: list[tuple[int, str]] = []  # (index in pages, hash) of pages only the host tier holds
        host = self._caches[HOST_COMPRESSED].hash_page
        room = len(self._pools[COMPRESSED].free) + len(self._lru)  # free or evictable device pages
        parent = None
        for i in range(limit):
            parent = page_hash(parent, tokens[i * P:(i + 1) * P], self.scheme_name)
            page = self._hash_page.get(parent)
            if page is None:
                if not restore or parent not in host or len(restores) >= room:
                    break
                restores.append((len(pages), parent))  # a spilled page: comes back from the host
                page = -1
            pages.append(page)
            hashes.append(parent)
        # Hits on evictable pages take them off the LRU list: restores get the room left, and the
        # prefix ends before the first restore that does not fit.
        while restores and len(restores) > room - sum(p >= 0 and p in self._lru for p in pages):
            cut = restores.pop()[0]
            del pages[cut:], hashes[cut:]
        for page in pages:
            if page >= 0:
                self._acquire_cached(page)  # off the LRU list first: the restores below cannot evict them
        to_device = []
        self._protect = {host[h] for _, h in restores}  # evictions below spill, never over these
        try:
            for _, h in restores:
                self._touch_host(h)  # most recently used: evicted last
            for i, h in restores:
                pages[i] = self._alloc(COMPRESSED)
                self._register(pages[i], h)
                to_device.append((COMPRESSED, host[h], pages[i]))
        finally:
            self._protect = set()
        spills, self._spills = self._spills, []
        self._seqs[seq_id] = _Seq(pages, len(pages) * P, len(pages), hashes, [], True)
        return len(pages) * P, TransferPlan(to_host=spills, to_device=to_device)

    def add_sequence_plan(self, seq_id: Hashable, token_ids: Sequence[int] | None = ()) -> tuple[int, TransferPlan]:
        """:meth:`add_sequence` that also restores prefix pages spilled to the host tier.

        Returns ``(cached tokens, plan)``: the caller must run
        ``plan.to_device`` (host page -> device page copies) before any kernel
        reads the sequence. Spilled pages come back only into free device
        pages; the hit stops at the first page that can come back from neither
        tier. Never raises OutOfPages.
        """
        return self._add(seq_id, token_ids, restore=True)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a new sequence sharing every page (and the length) of ``parent_id``.

        Costs no pages: the pages' ref counts go up, and whichever sequence
        first appends into the shared tail page copies it.
        """
        p = self._seq(parent_id)
        check_seq_id(child_id)
        if child_id in self._seqs:
            raise KvgenRuntimeError(f"sequence {child_id!r} already exists; fork into a new id")
        for i, page in enumerate(p.table):
            self._pools[self._pool_of(p, i)].ref[page] += 1
        self._seqs[child_id] = _Seq(array("i", p.table), p.length, p.num_compressed,
                                    list(p.hashes), list(p.pending), p.known, p.cold, p.swapped)

    def free(self, seq_id: Hashable) -> None:
        """Forget the sequence and drop its page references.

        A page no longer referenced goes to its free list, or, if it is in the
        prefix cache, to the end of the LRU list. Pages are released tail
        first, so a sequence's later pages are evicted before its earlier ones
        (a cached page is useless once its parent page is gone).
        """
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        for i in range(len(s.table) - 1, -1, -1):
            self._release(self._pool_of(s, i), s.table[i])

    # -- internals ----------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except TypeError:
            check_seq_id(seq_id)
            raise
        except KeyError:
            raise UnknownSequence(
                f"sequence {seq_id!r} is not live (never added or already freed); call add_sequence first") from None

    def _live(self, seq_id: Hashable) -> _Seq:
        """The sequence, which a step may extend (not swapped out)."""
        s = self._seq(seq_id)
        if s.swapped:
            raise SwappedOut(f"sequence {seq_id!r} is swapped out to the host tier; swap_in({seq_id!r}) first")
        return s

    @staticmethod
    def _pool_of(s: _Seq, i: int) -> str:
        """The pool holding logical page ``i`` of ``s`` (one of the four)."""
        base = COMPRESSED if i < s.num_compressed else RESIDUAL
        return HOST[base] if s.swapped or i < s.cold else base

    def _pool(self, pool: str) -> _Pool:
        try:
            return self._pools[pool]
        except (KeyError, TypeError):
            raise KvgenRuntimeError(f"unknown pool {pool!r}; use one of {list(self._pools)}") from None

    # Every mutation an append makes (see .reservation) goes through these helpers, which log how
    # to undo it while a reserve_step is open (self._journal is a list).
    def _alloc(self, pool: str) -> int:
        """Take a page of ``pool`` (ref 1): a free one, else the least recently released cached one.

        The callers counted what is available first: for the compressed pools
        free plus evictable, else free. A device page evicted from the prefix
        cache spills to the host tier when there is one (see :meth:`_spill`).
        """
        p = self._pools[pool]
        j = self._journal
        if p.free:
            page = p.free.pop()
            if j is not None:
                j.append((J.FREE_POP, pool, page))
        else:
            cache = self._caches[pool]
            page, stamp = cache.lru.popitem(last=False)
            h = cache.page_hash.pop(page)
            del cache.hash_page[h]
            if j is not None:
                j.append((J.LRU_REMOVE, pool, page, stamp, h))
            if pool == COMPRESSED:
                self._spill(page, h)
        self._set_ref(pool, page, 1)
        return page

    def _release(self, pool: str, page: int) -> None:
        p = self._pools[pool]
        self._set_ref(pool, page, p.ref[page] - 1)
        if p.ref[page] == 0:
            if self._held_set and (pool, page) in self._held_set:
                return  # an asynchronous copy still reads it: release_held drops it
            if self._parked is not None:  # inside a step (or a swap): out of reach until it ends
                self._parked.append((pool, page))
                if self._journal is not None:
                    self._journal.append((J.PARK,))
            else:
                self._drop(pool, page)

    def _drop(self, pool: str, page: int) -> None:
        """Put an unreferenced page on its free list, or, if it is cached, at the end of its LRU list."""
        j = self._journal
        cache = self._caches.get(pool)
        if cache is not None and page in cache.page_hash:
            cache.lru[page] = self._stamp
            self._stamp += 1
            if j is not None:
                j.append((J.LRU_ADD, pool, page))
        else:
            self._pools[pool].free.append(page)
            if j is not None:
                j.append((J.FREE_PUSH, pool))

    def _unpark(self) -> None:
        """Release the pages parked so far in this step (in the order they were parked)."""
        parked = self._parked
        for pool, page in parked:
            if self._pools[pool].ref[page] == 0:  # not revived meanwhile by a prefix-cache reuse
                self._drop(pool, page)
        if self._journal is not None:
            self._journal.append((J.UNPARK, list(parked)))
        parked.clear()

    def _acquire_cached(self, page: int) -> None:
        p = self._pools[COMPRESSED]
        lru = self._caches[COMPRESSED].lru
        if p.ref[page] == 0 and page in lru:  # (else parked or held: skipped there once referenced)
            stamp = lru.pop(page)
            if self._journal is not None:
                self._journal.append((J.LRU_REMOVE, COMPRESSED, page, stamp, None))
        self._set_ref(COMPRESSED, page, p.ref[page] + 1)

    def _register(self, page: int, h: str, pool: str = COMPRESSED) -> None:
        # First page registered under a hash wins; an equal page filled later
        # stays private (it is freed, not cached, when released).
        cache = self._caches[pool]
        if h not in cache.hash_page and page not in cache.page_hash:
            cache.hash_page[h] = page
            cache.page_hash[page] = h
            if self._journal is not None:
                self._journal.append((J.REGISTER, pool, page, h))

    def _set_ref(self, pool: str, page: int, value: int) -> None:
        ref = self._pools[pool].ref
        if self._journal is not None:
            self._journal.append((J.REF, pool, page, ref[page]))
        ref[page] = value

    def _set_table(self, s: _Seq, index: int, page: int) -> None:
        if self._journal is not None:
            self._journal.append((J.TABLE_SET, s, index, s.table[index]))
        s.table[index] = page
