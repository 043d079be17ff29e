"""Page accounting for a paged KV cache: free lists, ref counts, copy-on-write, prefix cache.

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

The manager is not thread-safe; call it from one thread (the scheduler's).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .errors import KvgenRuntimeError, OutOfPages, UnknownSequence

COMPRESSED = "compressed"
"""Name of the compressed pool (the scheme's quantized pages)."""
RESIDUAL = "residual"
"""Name of the residual pool (recent tokens in the compute dtype)."""
POOLS = (COMPRESSED, RESIDUAL)


def page_hash(parent: str | None, token_ids: Sequence[int], scheme_name: str = "") -> str:
    """The prefix-cache key of a full page: a hex sha256, the same in every process.

    ``parent`` is the key of the previous page of the sequence (None for the
    first page), so a key names the page's whole prefix, not only its tokens.
    """
    key = (parent, tuple(int(t) for t in token_ids), scheme_name)
    return hashlib.sha256(repr(key).encode()).hexdigest()


@dataclass(frozen=True)
class AppendPlan:
    """What the caller must do, in this order, to store the tokens of one append.

    1. ``copies``: for each ``(pool, src, dst)``, copy page ``src`` of ``pool``
       into page ``dst`` of the same pool (copy-on-write of a shared page).
    2. Write the new tokens' K and V: token ``j`` of the append goes to
       ``slots[j] = page * page_size + offset`` in ``write_pool`` (the residual
       pool for schemes with a residual, else the compressed pool, quantizing).
    3. ``conversions``: for each ``(src, dst)``, quantize residual page ``src``
       (now full, after step 2) into compressed page ``dst``. The manager has
       already released ``src``: the very next :meth:`BlockManager.append` may
       hand it out again. Running each plan's three steps before the next
       plan's writes (on one CUDA stream) is safe; a caller that batches the
       writes of several appends before their conversions must keep such pages
       from being reused meanwhile (``step.reserve_step`` does).
    """

    slots: list[int]
    copies: list[tuple[str, int, int]] = field(default_factory=list)
    conversions: list[tuple[int, int]] = field(default_factory=list)
    write_pool: str = COMPRESSED


@dataclass
class _Pool:
    size: int
    ref: list[int]
    free: deque  # LIFO: pop() from the right, push to the right

    @classmethod
    def new(cls, size: int) -> _Pool:
        # reversed so that a fresh pool hands out 0, 1, 2, ...
        return cls(size, [0] * size, deque(range(size - 1, -1, -1)))


@dataclass
class _Seq:
    table: list[int]
    length: int
    num_compressed: int
    hashes: list[str]    # chain hashes of the first len(hashes) full pages
    pending: list[int]   # token ids of the partial tail page, while ids are known
    known: bool          # every token id so far was given (else no more hashing)


@dataclass
class _Draft:
    """An append worked out without touching any state."""

    cow: bool
    new_pages: int
    new_hashes: list[str]
    pending: list[int]
    known: bool
    num_compressed: int
    convert: list[tuple[int, str | None, int | None]]  # (logical page, hash, cached page to reuse)
    register: list[tuple[int, str]]                      # (logical page, hash), no-residual schemes


class BlockManager:
    """Allocates pages of a two-pool paged KV cache to sequences.

    ``BlockManager(page_size, num_compressed_pages, num_residual_pages,
    residual_tokens, scheme_name="")``: ``residual_tokens`` is the scheme's
    (None: no residual pool is used; ``R >= 0``: the tail page and ``R //
    page_size`` recent full pages are residual). ``scheme_name`` goes into the
    prefix hashes so two schemes never share pages.

    Guarantees:

    - allocate and free are O(1) (a LIFO free list per pool); each page is, at
      any time, exactly one of: referenced by block tables (its ref count is
      the number of references), on the free list, or cached-and-evictable;
    - a page referenced by more than one sequence is never written: the first
      append into it copies it first (copy-on-write);
    - any call that raises leaves every structure exactly as it was; in
      particular :class:`OutOfPages` can be caught to preempt and retry;
    - identical call sequences give identical decisions on every process.
    """

    def __init__(self, page_size: int, num_compressed_pages: int, num_residual_pages: int,
                 residual_tokens: int | None, scheme_name: str = "") -> None:
        for name, value, low in (("page_size", page_size, 1),
                                 ("num_compressed_pages", num_compressed_pages, 0),
                                 ("num_residual_pages", num_residual_pages, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise KvgenRuntimeError(f"BlockManager {name} must be an int >= {low}, got {value!r}")
        if residual_tokens is not None and (not isinstance(residual_tokens, int) or residual_tokens < 0):
            raise KvgenRuntimeError(
                f"BlockManager residual_tokens must be None or an int >= 0, got {residual_tokens!r}")
        self.page_size = page_size
        self.residual_tokens = residual_tokens
        self.scheme_name = scheme_name
        self.write_pool = COMPRESSED if residual_tokens is None else RESIDUAL
        self._window = None if residual_tokens is None else residual_tokens // page_size
        self._pools = {COMPRESSED: _Pool.new(num_compressed_pages), RESIDUAL: _Pool.new(num_residual_pages)}
        # Prefix cache (compressed pool only): hash <-> page, and the evictable
        # cached pages (ref count 0), least recently released first.
        self._hash_page: dict[str, int] = {}
        self._page_hash: dict[int, str] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[Hashable, _Seq] = {}

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
        return n + len(self._lru) if pool == COMPRESSED else n

    def ref_count(self, pool: str, page: int) -> int:
        """Number of block-table references to ``page`` of ``pool``."""
        p = self._pool(pool)
        if not isinstance(page, int) or not 0 <= page < p.size:
            raise KvgenRuntimeError(f"page {page!r} is not in the {pool} pool (ids 0..{p.size - 1})")
        return p.ref[page]

    def can_append(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> bool:
        """True when :meth:`append` with these arguments would not raise OutOfPages."""
        try:
            self._prepare(seq_id, self._seq(seq_id), num_tokens, self._token_list(token_ids, num_tokens))
        except OutOfPages:
            return False
        return True

    # -- mutations ----------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] = ()) -> int:
        """Register a new sequence and reuse the longest cached prefix of ``token_ids``.

        Returns how many leading tokens of ``token_ids`` already have their KV
        in the cache: a multiple of ``page_size``. The sequence starts with
        that length, sharing those pages; the caller appends only the
        remaining tokens (pass their ids to :meth:`append` so they can be
        cached in turn). Every token may hit; a caller that needs the logits
        of the last prompt token passes ``prompt[:-1]`` here. For residual
        schemes only pages that will be compressed once all of ``token_ids``
        are appended can hit. Never allocates, so never raises OutOfPages.
        Raises KvgenRuntimeError if ``seq_id`` is already live.
        """
        if seq_id in self._seqs:
            raise KvgenRuntimeError(f"sequence {seq_id!r} already exists; free it first or use a new id")
        tokens = self._token_list(token_ids, None)
        P = self.page_size
        full = len(tokens) // P
        limit = full if self._window is None else max(0, full - self._window)
        pages: list[int] = []
        hashes: list[str] = []
        parent = None
        for i in range(limit):
            parent = page_hash(parent, tokens[i * P:(i + 1) * P], self.scheme_name)
            page = self._hash_page.get(parent)
            if page is None:
                break
            pages.append(page)
            hashes.append(parent)
        for page in pages:
            self._acquire_cached(page)
        self._seqs[seq_id] = _Seq(pages, len(pages) * P, len(pages), hashes, [], True)
        return len(pages) * P

    def append(self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None) -> AppendPlan:
        """Reserve slots for ``num_tokens`` new tokens of the sequence; see :class:`AppendPlan`.

        Allocates the pages the tokens need, copies the tail page first if it
        is shared, converts pages that leave the residual window, and returns
        what the caller must do. ``token_ids`` (``num_tokens`` ids) lets the
        pages that fill up be registered in the prefix cache; once an append
        of a sequence omits them, none of its later pages is cached.

        Atomic: raises :class:`OutOfPages` (after counting evictable cached
        pages as available) with no state changed. Raises UnknownSequence for
        an id that is not live.
        """
        s = self._seq(seq_id)
        tokens = self._token_list(token_ids, num_tokens)
        d = self._prepare(seq_id, s, num_tokens, tokens)
        # -- from here on nothing can fail --
        P = self.page_size
        W = self.write_pool
        copies: list[tuple[str, int, int]] = []
        if d.cow:
            idx = s.length // P
            src = s.table[idx]
            dst = self._alloc(W)
            self._pools[W].ref[src] -= 1  # was > 1, so the page stays referenced
            s.table[idx] = dst
            copies.append((W, src, dst))
        for _ in range(d.new_pages):
            s.table.append(self._alloc(W))
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
            s.table[i] = dst
            self._release(RESIDUAL, src)
        for i, h in d.register:
            self._register(s.table[i], h)

        s.length += num_tokens
        s.num_compressed = d.num_compressed
        s.hashes.extend(d.new_hashes)
        s.pending = d.pending
        s.known = d.known
        return AppendPlan(slots, copies, conversions, W)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a new sequence sharing every page (and the length) of ``parent_id``.

        Costs no pages: the pages' ref counts go up, and whichever sequence
        first appends into the shared tail page copies it.
        """
        p = self._seq(parent_id)
        if child_id in self._seqs:
            raise KvgenRuntimeError(f"sequence {child_id!r} already exists; fork into a new id")
        for i, page in enumerate(p.table):
            self._pools[COMPRESSED if i < p.num_compressed else RESIDUAL].ref[page] += 1
        self._seqs[child_id] = _Seq(list(p.table), p.length, p.num_compressed,
                                    list(p.hashes), list(p.pending), p.known)

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
            self._release(COMPRESSED if i < s.num_compressed else RESIDUAL, s.table[i])

    # -- internals ----------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(
                f"sequence {seq_id!r} is not live (never added or already freed); call add_sequence first") from None

    def _pool(self, pool: str) -> _Pool:
        try:
            return self._pools[pool]
        except (KeyError, TypeError):
            raise KvgenRuntimeError(f"unknown pool {pool!r}; use {COMPRESSED!r} or {RESIDUAL!r}") from None

    @staticmethod
    def _token_list(token_ids: Sequence[int] | None, expected: int | None) -> list[int] | None:
        if token_ids is None:
            return None
        tokens = [int(t) for t in token_ids]
        if expected is not None and len(tokens) != expected:
            raise KvgenRuntimeError(
                f"append got {len(tokens)} token ids for {expected} tokens; pass one id per token or None")
        return tokens

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
        hashes = s.hashes + new_hashes

        convert: list[tuple[int, str | None, int | None]] = []
        register: list[tuple[int, str]] = []
        need_c = 0
        revived = 0
        if self._window is None:
            num_compressed = -(-n1 // P)
            register = [(i, hashes[i]) for i in range(n0 // P, min(n1 // P, len(hashes)))]
            need_w = int(cow) + new_pages
            avail_w = len(self._pools[W].free) + len(self._lru)
        else:
            num_compressed = max(s.num_compressed, self.compressed_pages(n1))
            for i in range(s.num_compressed, num_compressed):
                h = hashes[i] if i < len(hashes) else None
                cached = self._hash_page.get(h) if h is not None else None
                if cached is None:
                    need_c += 1
                elif self._pools[COMPRESSED].ref[cached] == 0:
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

    def _alloc(self, pool: str) -> int:
        p = self._pools[pool]
        if p.free:
            page = p.free.pop()
        else:
            # only reached for the compressed pool after _prepare counted the LRU list
            page, _ = self._lru.popitem(last=False)
            del self._hash_page[self._page_hash.pop(page)]
        p.ref[page] = 1
        return page

    def _release(self, pool: str, page: int) -> None:
        p = self._pools[pool]
        p.ref[page] -= 1
        if p.ref[page] == 0:
            if pool == COMPRESSED and page in self._page_hash:
                self._lru[page] = None
            else:
                p.free.append(page)

    def _acquire_cached(self, page: int) -> None:
        p = self._pools[COMPRESSED]
        if p.ref[page] == 0:
            del self._lru[page]
        p.ref[page] += 1

    def _register(self, page: int, h: str) -> None:
        # First page registered under a hash wins; an equal page filled later
        # stays private (it is freed, not cached, when released).
        if h not in self._hash_page and page not in self._page_hash:
            self._hash_page[h] = page
            self._page_hash[page] = h
