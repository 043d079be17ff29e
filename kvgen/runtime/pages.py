"""The records of page accounting: plans the block manager returns, and its books.

:class:`AppendPlan`, :class:`Phase` and :class:`StepPlan` are what
:class:`~.block_manager.BlockManager` tells its caller to do;
``_Pool``, ``_Seq``, ``_PrefixCache`` and ``_Draft`` are the manager's own
books (private to it and to its mixins, :mod:`.reservation` and :mod:`.tiering`). :func:`page_hash` names a
full page in the prefix cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

COMPRESSED = "compressed"
"""Name of the compressed pool (the scheme's quantized pages)."""
RESIDUAL = "residual"
"""Name of the residual pool (recent tokens in the compute dtype)."""


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
       plan's writes (on one CUDA stream) is safe; to batch the writes of
       several appends before their conversions, use
       :meth:`BlockManager.reserve_step`, which keeps such pages out of reach
       until the step ends.
    """

    slots: list[int]
    copies: list[tuple[str, int, int]] = field(default_factory=list)
    conversions: list[tuple[int, int]] = field(default_factory=list)
    write_pool: str = COMPRESSED
    spills: list[tuple[str, int, int]] = field(default_factory=list)
    """Run before everything else: ``(pool, device page, host page)`` copies of evicted prefix-cache
    pages to the host tier (the append then overwrites the device page)."""


@dataclass
class Phase:
    """Tokens ``[start, end)`` of a step (in step order) and the page work around their write.

    Per layer a phase runs its ``copies`` (``(pool, src, dst)``), writes its
    tokens, then runs its ``conversions`` (``(src, dst)``); phases run in
    order. A new phase starts only when a residual-scheme append needs the
    residual pages that earlier conversions of the step released.
    """

    start: int
    end: int = 0
    copies: list[tuple[str, int, int]] = field(default_factory=list)
    conversions: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class StepPlan:
    """What :meth:`BlockManager.reserve_step` decided: every new token's slot (step order) and the phases.

    ``slots[j]`` is ``page * page_size + offset`` in the manager's
    ``write_pool``; phase ``i`` writes ``slots[phases[i].start:phases[i].end]``.
    """

    slots: list[int]
    phases: list[Phase]
    spills: list[tuple[str, int, int]] = field(default_factory=list)
    """``(pool, device page, host page)`` copies to run before any phase (see :class:`AppendPlan`)."""


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
    # A C int array, not a list: every step copies each running sequence's table into one upload buffer
    # (step.build_step), and an array extends an array by memcpy where a list's ints convert one by one
    # (with the reservation shortcut, 1.0-1.8 -> 0.2-0.3 ms a host step at 12 x 2,048 pages on a CPU;
    # benchmarks/results/2026-12-02-cpu-host-step/).
    table: array
    length: int
    num_compressed: int
    hashes: list[str]    # chain hashes of the first len(hashes) full pages
    pending: list[int]   # token ids of the partial tail page, while ids are known
    known: bool          # every token id so far was given (else no more hashing)
    cold: int = 0        # leading pages held in the host tier (full compressed pages)
    swapped: bool = False  # every page is in the host tier (swapped out): no step may touch it

    def __post_init__(self) -> None:
        if not isinstance(self.table, array) or self.table.typecode != "i":
            self.table = array("i", self.table)


@dataclass
class _PrefixCache:
    """Hash <-> page of one tier's prefix cache, and its evictable pages (ref 0) -> release stamp."""

    hash_page: dict = field(default_factory=dict)
    page_hash: dict = field(default_factory=dict)
    lru: OrderedDict = field(default_factory=OrderedDict)  # least recently released first


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
