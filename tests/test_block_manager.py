"""BlockManager: page accounting, copy-on-write, prefix cache, LRU, atomic OutOfPages.

The stateful tests drive a BlockManager with random add / prefix-hit / fork /
append / free calls while simulating the page contents the caller would
write: every token's "KV" is the tuple of the sequence's token ids up to and
including it, so a page shared or reused from the prefix cache reads back
right only if it really holds the same prefix. After every step each
sequence's content, read through its block table, must equal what was
appended to it, and the pools' books must balance.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.runtime.block_manager import (COMPRESSED, HOST, HOST_COMPRESSED, HOST_RESIDUAL, RESIDUAL, AppendPlan,
                                         BlockManager, page_hash)
from kvgen.runtime.errors import KvgenRuntimeError, OutOfPages, SwappedOut, UnknownSequence

POISON = "freed"


def kv(tokens: list[int], i: int) -> tuple[int, ...]:
    """The simulated KV of token ``i``: it depends on the whole prefix, as real KV does."""
    return tuple(tokens[: i + 1])


class _Cache(RuleBasedStateMachine):
    """Random calls against one BlockManager plus a simulated page memory."""

    P = 2
    R: int | None = None
    NC = 10
    NR = 0
    NH = 0   # host tier: compressed and residual pages
    NHR = 0

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.P, self.NC, self.NR, self.R, "scheme", self.NH, self.NHR)
        self.mem: dict[tuple[str, int], list] = {}
        self.tokens: dict[int, list[int]] = {}   # every token of each live sequence
        self.pinned: dict[int, int] = {}         # pages reused from the prefix cache at add time
        self.history: list[list[int]] = [[]]     # token lists the manager has seen, for prefix hits
        self.next_id = 0
        self.hits = 0

    # -- helpers --------------------------------------------------------------
    def _expected_nc(self, sid: int) -> int:
        n, P = len(self.tokens[sid]), self.P
        formula = -(-n // P) if self.R is None else max(0, n // P - self.R // P)
        return max(self.pinned[sid], formula)

    def _append(self, sid: int, new: list[int], with_ids: bool) -> None:
        bm = self.bm
        ids = new if with_ids else None
        expect_ok = bm.can_append(sid, len(new), ids)
        before = copy.deepcopy(vars(bm))
        try:
            plan = bm.append(sid, len(new), ids)
        except OutOfPages:
            assert not expect_ok
            assert vars(bm) == before, "OutOfPages changed the manager's state"
            return
        assert expect_ok
        assert isinstance(plan, AppendPlan)
        for pool, dev, host in plan.spills:  # evicted prefix pages go to the host before anything else
            self.mem[(HOST[pool], host)] = list(self.mem[(pool, dev)])
        assert plan.write_pool == (COMPRESSED if self.R is None else RESIDUAL)
        assert len(plan.slots) == len(new)
        if self.R is None:
            assert plan.conversions == []
        # 1. copies, 2. writes, 3. conversions -- the order AppendPlan documents
        for pool, src, dst in plan.copies:
            assert pool == plan.write_pool
            self.mem[(pool, dst)] = list(self.mem[(pool, src)])
        base = self.tokens[sid]
        full = base + new
        for j, slot in enumerate(plan.slots):
            page, off = divmod(slot, self.P)
            self.mem.setdefault((plan.write_pool, page), [POISON] * self.P)[off] = kv(full, len(base) + j)
        for src, dst in plan.conversions:
            self.mem[(COMPRESSED, dst)] = list(self.mem[(RESIDUAL, src)])
        self.tokens[sid] = full
        if with_ids and len(self.history) < 30:
            self.history.append(full)

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    # -- rules ------------------------------------------------------------------
    @rule(data=st.data(), with_prompt=st.booleans())
    def add(self, data, with_prompt: bool) -> None:
        sid = self.next_id
        self.next_id += 1
        prompt: list[int] = []
        if with_prompt:
            base = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(0, len(base)))
            prompt = base[:cut] + data.draw(st.lists(st.integers(0, 1), max_size=2 * self.P + 1))
        hit = self._add_seq(sid, prompt)
        assert hit % self.P == 0 and 0 <= hit <= len(prompt)
        if self.R is not None:
            assert hit // self.P <= max(0, len(prompt) // self.P - self.R // self.P)
        self.hits += hit > 0
        self.tokens[sid] = prompt[:hit]
        self.pinned[sid] = hit // self.P
        assert self.bm.seq_len(sid) == hit
        # the reused pages must hold exactly the KV of these tokens: checked by the invariant
        self.check_books()
        if hit < len(prompt):
            self._append(sid, prompt[hit:], True)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), with_ids=st.booleans())
    def append(self, data, with_ids: bool) -> None:
        sid = self._pick(data)
        new = data.draw(st.lists(st.integers(0, 1), min_size=0, max_size=2 * self.P + 1))
        self._append(sid, new, with_ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self._pick(data)
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.pinned[child] = self.pinned[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self._pick(data)
        self.bm.free(sid)
        del self.tokens[sid]
        del self.pinned[sid]

    def _add_seq(self, sid: int, prompt: list[int]) -> int:
        return self.bm.add_sequence(sid, prompt)

    # -- invariants -------------------------------------------------------------
    @invariant()
    def check_books(self) -> None:
        bm, P = self.bm, self.P
        assert bm.sequences() == [s for s in self.tokens]  # both in insertion order
        refs: Counter = Counter()
        for sid, toks in self.tokens.items():
            table, nc, n = bm.block_table(sid), bm.num_compressed(sid), bm.seq_len(sid)
            on_host = bm.host_pages(sid)
            assert n == len(toks)
            assert len(table) == -(-n // P)
            assert nc == self._expected_nc(sid)
            pools = [(HOST if i < on_host else {COMPRESSED: COMPRESSED, RESIDUAL: RESIDUAL})[
                COMPRESSED if i < nc else RESIDUAL] for i in range(len(table))]
            for pool, page in zip(pools, table):
                refs[(pool, page)] += 1
            got = [self.mem[(pools[i // P], table[i // P])][i % P] for i in range(n)]
            assert got == [kv(toks, i) for i in range(n)], f"sequence {sid} reads wrong KV"
        held = set(bm._held_set)
        for pool, size in ((COMPRESSED, self.NC), (RESIDUAL, self.NR), (HOST_COMPRESSED, self.NH),
                           (HOST_RESIDUAL, self.NHR)):
            free = list(bm._pools[pool].free)
            cache = bm._caches.get(pool)
            evictable = list(cache.lru) if cache is not None else []
            assert len(set(free)) == len(free), f"{pool} page freed twice"
            assert len(set(evictable)) == len(evictable)
            assert not set(free) & set(evictable)
            referenced = 0
            held_here = 0
            for page in range(size):
                r = bm.ref_count(pool, page)
                assert r == refs[(pool, page)], f"{pool} page {page}: ref {r}, {refs[(pool, page)]} references"
                on_lists = (page in free) + (page in evictable)
                if (pool, page) in held:  # an asynchronous copy still reads it: on no list
                    assert on_lists == 0, f"{pool} page {page} is held and listed"
                    held_here += r == 0
                else:
                    assert on_lists == (0 if r else 1), f"{pool} page {page} leaked or double-listed"
                referenced += r > 0
            assert referenced + len(free) + len(evictable) + held_here == size, f"{pool} pages leaked"
            assert bm.num_free_pages(pool) == len(free) + len(evictable)
            for page in free:  # a freed page's old content must never be read again
                self.mem[(pool, page)] = [POISON] * P
            if cache is not None:  # prefix-cache maps agree, and every evictable page is a cached one
                assert {h: p for p, h in cache.page_hash.items()} == cache.hash_page
                assert all(p in cache.page_hash for p in evictable)


_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class _NoResidual(_Cache):
    P, R, NC, NR = 2, None, 10, 0


class _ResidualZero(_Cache):
    P, R, NC, NR = 3, 0, 10, 4


class _ResidualTwoPages(_Cache):
    P, R, NC, NR = 2, 4, 3, 16


class _Tiered(_Cache):
    """The same machine with a host tier: swap out / in, cold pages, prefix spill and restore."""

    def __init__(self) -> None:
        super().__init__()
        self.tickets: list[int] = []

    def _add_seq(self, sid: int, prompt: list[int]) -> int:
        hit, plan = self.bm.add_sequence_plan(sid, prompt)
        self._run(plan)
        return hit

    def _run(self, plan) -> None:
        for pool, dev, host in plan.to_host:
            self.mem[(HOST[pool], host)] = list(self.mem[(pool, dev)])
        for pool, host, dev in plan.to_device:
            self.mem[(pool, dev)] = list(self.mem[(HOST[pool], host)])
        if plan.ticket is not None:
            self.tickets.append(plan.ticket)

    def _live(self) -> list[int]:
        return [s for s in sorted(self.tokens) if not self.bm.is_swapped(s)]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), with_ids=st.booleans())
    def append(self, data, with_ids: bool) -> None:
        live = self._live()
        if len(live) < len(self.tokens):  # a swapped-out sequence refuses appends, changing nothing
            sid = next(s for s in sorted(self.tokens) if s not in live)
            before = copy.deepcopy(vars(self.bm))
            with pytest.raises(SwappedOut):
                self.bm.append(sid, 1)
            assert vars(self.bm) == before
        if live:
            new = data.draw(st.lists(st.integers(0, 1), min_size=0, max_size=2 * self.P + 1))
            self._append(data.draw(st.sampled_from(live)), new, with_ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), hold=st.booleans())
    def swap_out(self, data, hold: bool) -> None:
        live = self._live()
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        before = copy.deepcopy(vars(self.bm))
        try:
            plan = self.bm.swap_out(ids, hold=hold)
        except OutOfPages:
            assert vars(self.bm) == before, "OutOfPages changed the manager's state"
            return
        hosts = [(pool, host) for pool, _, host in plan.to_host]
        assert len(set(hosts)) == len(hosts)  # a page shared by the swapped sequences is copied once
        self._run(plan)
        assert all(self.bm.is_swapped(s) for s in ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        on_host = [s for s in sorted(self.tokens) if self.bm.host_pages(s)]
        if not on_host:
            return
        ids = data.draw(st.lists(st.sampled_from(on_host), min_size=1, max_size=3, unique=True))
        before = copy.deepcopy(vars(self.bm))
        try:
            plan = self.bm.swap_in(ids)
        except OutOfPages:
            assert vars(self.bm) == before, "OutOfPages changed the manager's state"
            return
        self._run(plan)
        assert all(self.bm.host_pages(s) == 0 for s in ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), hold=st.booleans())
    def make_cold(self, data, hold: bool) -> None:
        live = self._live()
        if not live:
            return
        sid = data.draw(st.sampled_from(live))
        limit = min(self.bm.num_compressed(sid), self.bm.seq_len(sid) // self.P)
        before = copy.deepcopy(vars(self.bm))
        try:
            plan = self.bm.make_cold(sid, data.draw(st.integers(0, limit)), hold=hold)
        except OutOfPages:
            assert vars(self.bm) == before, "OutOfPages changed the manager's state"
            return
        self._run(plan)

    @precondition(lambda self: self.tickets)
    @rule()
    def release_held(self) -> None:
        self.bm.release_held(self.tickets.pop(0))

    def teardown(self) -> None:
        for t in self.tickets:
            self.bm.release_held(t)
        for sid in list(self.tokens):
            self.bm.free(sid)
        for pool, size in ((COMPRESSED, self.NC), (RESIDUAL, self.NR), (HOST_COMPRESSED, self.NH),
                           (HOST_RESIDUAL, self.NHR)):
            assert self.bm.num_free_pages(pool) == size, f"{pool} pages leaked"


class _TieredNoResidual(_Tiered):
    P, R, NC, NR, NH, NHR = 2, None, 8, 0, 8, 0


class _TieredResidual(_Tiered):
    P, R, NC, NR, NH, NHR = 2, 2, 6, 8, 6, 6


TestTieredNoResidual = _TieredNoResidual.TestCase
TestTieredNoResidual.settings = _SETTINGS
TestTieredResidual = _TieredResidual.TestCase
TestTieredResidual.settings = _SETTINGS
TestNoResidual = _NoResidual.TestCase
TestNoResidual.settings = _SETTINGS
TestResidualZero = _ResidualZero.TestCase
TestResidualZero.settings = _SETTINGS
TestResidualTwoPages = _ResidualTwoPages.TestCase
TestResidualTwoPages.settings = _SETTINGS


# -- unit tests -------------------------------------------------------------------
def test_fresh_pool_allocates_in_order_and_slots_are_page_times_size_plus_offset():
    bm = BlockManager(4, 8, 0, None)
    bm.add_sequence("a")
    plan = bm.append("a", 6)
    assert plan.slots == [0, 1, 2, 3, 4, 5]
    assert bm.block_table("a") == [0, 1]
    assert bm.num_compressed("a") == 2 and bm.seq_len("a") == 6
    assert bm.num_free_pages(COMPRESSED) == 6
    assert bm.append("a", 0) == AppendPlan([], [], [], COMPRESSED)


def test_copy_on_write_no_residual():
    bm = BlockManager(4, 8, 0, None)
    bm.add_sequence("a")
    bm.append("a", 6)                      # pages [0, 1], page 1 half full
    bm.fork("a", "b")
    assert bm.ref_count(COMPRESSED, 0) == 2 and bm.ref_count(COMPRESSED, 1) == 2
    plan = bm.append("b", 1)
    assert plan.copies == [(COMPRESSED, 1, 2)]
    assert plan.slots == [2 * 4 + 2]
    assert bm.block_table("b") == [0, 2] and bm.block_table("a") == [0, 1]
    assert bm.ref_count(COMPRESSED, 1) == 1 and bm.ref_count(COMPRESSED, 0) == 2
    plan = bm.append("a", 1)               # a is now the only owner of page 1: no copy
    assert plan.copies == [] and plan.slots == [1 * 4 + 2]


def test_fork_at_page_boundary_needs_no_copy():
    bm = BlockManager(2, 8, 0, None)
    bm.add_sequence("a")
    bm.append("a", 4)
    bm.fork("a", "b")
    plan = bm.append("b", 1)
    assert plan.copies == [] and bm.block_table("b") == [0, 1, 2]


def test_copy_on_write_residual_pool():
    bm = BlockManager(4, 8, 4, 0)
    bm.add_sequence("a")
    plan = bm.append("a", 2)
    assert plan.write_pool == RESIDUAL and plan.slots == [0, 1]
    bm.fork("a", "b")
    plan = bm.append("b", 2)               # fills the shared residual page: copy, then convert
    assert plan.copies == [(RESIDUAL, 0, 1)]
    assert plan.slots == [6, 7]
    assert plan.conversions == [(1, 0)]
    assert bm.block_table("b") == [0] and bm.num_compressed("b") == 1
    assert bm.ref_count(RESIDUAL, 1) == 0 and bm.ref_count(RESIDUAL, 0) == 1
    assert bm.num_free_pages(RESIDUAL) == 3


def test_residual_window_conversions():
    bm = BlockManager(2, 8, 8, 4)          # two full pages stay residual
    bm.add_sequence("a")
    plan = bm.append("a", 5)               # pages 0, 1 full + tail: nothing to convert yet
    assert plan.conversions == [] and bm.num_compressed("a") == 0
    plan = bm.append("a", 1)               # 6 tokens: 3 full pages, the oldest leaves the window
    assert plan.conversions == [(0, 0)]
    assert bm.num_compressed("a") == 1
    assert bm.block_table("a") == [0, 1, 2]  # compressed 0, then residual 1, 2
    assert bm.ref_count(RESIDUAL, 0) == 0 and bm.ref_count(COMPRESSED, 0) == 1
    plan = bm.append("a", 5)               # 11 tokens: 5 full pages, 3 compressed
    assert [src for src, _ in plan.conversions] == [1, 2]
    assert bm.num_compressed("a") == 3


def test_prefix_hit_counts_whole_pages():
    bm = BlockManager(4, 16, 0, None, "int8")
    bm.add_sequence("a", list(range(10)))
    bm.append("a", 10, list(range(10)))    # pages [0..3], [4..7] full and cached
    assert bm.add_sequence("b", list(range(8)) + [99, 98]) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.ref_count(COMPRESSED, bm.block_table("a")[0]) == 2
    assert bm.add_sequence("c", [0, 1, 2, 3, 7, 7, 7, 7]) == 4
    assert bm.add_sequence("d", [1, 2, 3, 4]) == 0
    assert bm.add_sequence("e", [0, 1, 2]) == 0  # no full page
    assert bm.add_sequence("f", list(range(8))) == 8  # whole prompt may hit
    assert bm.seq_len("f") == 8 and bm.num_compressed("f") == 2


def test_prefix_cache_is_per_scheme_and_needs_token_ids():
    bm = BlockManager(2, 8, 0, None, "int8")
    bm.add_sequence("a")
    bm.append("a", 4)                      # no token ids: never cached
    assert bm.add_sequence("b", [0, 1, 2, 3]) == 0
    bm.append("b", 4, [0, 1, 2, 3])
    bm.append("b", 2)                      # ids dropped: this and later pages never cached
    bm.append("b", 2, [6, 6])
    assert bm.add_sequence("c", [0, 1, 2, 3, 5, 5]) == 4
    assert bm.add_sequence("c2", [0, 1, 2, 3, 5, 5, 6, 6]) == 4
    assert page_hash(None, [0, 1], "int8") != page_hash(None, [0, 1], "fp8")
    other = BlockManager(2, 8, 0, None, "fp8")
    assert other.add_sequence("x", [0, 1]) == 0


def test_prefix_hit_residual_scheme_only_final_compressed_pages():
    bm = BlockManager(2, 8, 8, 4, "kivi")  # R = 2 pages
    toks = [1, 2, 3, 4, 5, 6, 7, 8]        # 4 full pages: 2 compressed, 2 residual
    bm.add_sequence("a", toks)
    bm.append("a", 8, toks)
    assert bm.num_compressed("a") == 2
    assert bm.add_sequence("b", toks) == 4             # only the 2 compressed pages
    assert bm.block_table("b") == bm.block_table("a")[:2] and bm.num_compressed("b") == 2
    assert bm.add_sequence("c", toks[:6]) == 2         # 3 full pages: 1 would be compressed
    assert bm.num_compressed("c") == 1 and bm.compressed_pages(2) == 0
    assert bm.add_sequence("d", toks[:4]) == 0         # both pages would stay residual
    plan = bm.append("b", 4, toks[4:])                  # the rest of the prompt: no conversion yet
    assert plan.conversions == [] and bm.num_compressed("b") == bm.compressed_pages(8) == 2


def test_conversion_reuses_an_already_cached_compressed_page():
    bm = BlockManager(2, 8, 8, 0, "kivi")
    bm.add_sequence("a")
    plan = bm.append("a", 2, [7, 8])
    assert plan.conversions == [(0, 0)]
    bm.add_sequence("b")
    plan = bm.append("b", 2, [7, 8])       # same prefix: share compressed page 0, no quantize
    assert plan.conversions == [] and plan.slots == [0, 1]
    assert bm.block_table("b") == [0] and bm.ref_count(COMPRESSED, 0) == 2
    assert bm.num_free_pages(RESIDUAL) == 8


def test_conversion_reusing_an_evictable_page_does_not_count_it_as_free():
    bm = BlockManager(2, 2, 8, 0, "kivi")
    bm.add_sequence("a")
    bm.append("a", 2, [7, 8])              # compressed page 0, cached
    bm.free("a")                           # page 0 evictable
    bm.add_sequence("x")
    bm.append("x", 2)                      # compressed page 1, not cached: pool now full
    bm.add_sequence("b")
    before = copy.deepcopy(vars(bm))
    assert not bm.can_append("b", 4, [7, 8, 1, 1])
    with pytest.raises(OutOfPages, match="compressed"):
        bm.append("b", 4, [7, 8, 1, 1])    # page 0 would be reused, so nothing is left to evict
    assert vars(bm) == before
    bm.free("x")
    plan = bm.append("b", 4, [7, 8, 1, 1])
    assert [dst for _, dst in plan.conversions] == [1] and bm.block_table("b") == [0, 1]


def test_lru_eviction_order_and_revival():
    bm = BlockManager(2, 4, 0, None)
    bm.add_sequence("a", [1, 2, 3, 4])
    bm.append("a", 4, [1, 2, 3, 4])        # pages 0 ([1,2]) and 1 ([3,4]) cached
    bm.add_sequence("x", [9, 9])
    bm.append("x", 2, [9, 9])              # page 2 cached
    bm.free("a")                           # tail first: LRU = [1, 0]
    bm.free("x")                           # LRU = [1, 0, 2]
    assert list(bm._lru) == [1, 0, 2]
    assert bm.num_free_pages(COMPRESSED) == 4
    bm.add_sequence("b")
    bm.append("b", 2)                      # takes the free page 3, evicts nothing
    assert bm.block_table("b") == [3] and list(bm._lru) == [1, 0, 2]
    bm.append("b", 2)                      # free list empty: evicts page 1 ([3,4]) first
    assert bm.block_table("b") == [3, 1] and list(bm._lru) == [0, 2]
    assert bm.add_sequence("c", [1, 2, 3, 4]) == 2   # [1,2] still cached, [3,4] gone
    assert list(bm._lru) == [2] and bm.ref_count(COMPRESSED, 0) == 1  # revived
    bm.append("b", 1)                      # evicts page 2 ([9,9])
    assert bm.block_table("b") == [3, 1, 2]
    assert bm.add_sequence("d", [9, 9]) == 0


def test_out_of_pages_is_atomic():
    bm = BlockManager(2, 3, 0, None)
    bm.add_sequence("a", [1, 2])
    bm.append("a", 2, [1, 2])
    bm.free("a")                           # page 0 is cached and evictable
    bm.add_sequence("b")
    bm.append("b", 3)                      # free pages 1 and 2; page 0 stays cached
    before = copy.deepcopy(vars(bm))
    assert not bm.can_append("b", 4)
    with pytest.raises(OutOfPages, match="compressed pool is out of pages"):
        bm.append("b", 4)                  # needs 2 pages, only the cached page 0 is evictable
    assert vars(bm) == before
    assert bm.add_sequence("c", [1, 2]) == 2  # the cached page was not evicted


def test_out_of_pages_residual_and_compressed_are_atomic():
    bm = BlockManager(2, 1, 2, 0)
    bm.add_sequence("a")
    bm.append("a", 2)                      # converted into compressed page 0
    before = copy.deepcopy(vars(bm))
    with pytest.raises(OutOfPages, match="residual"):
        bm.append("a", 6)                  # needs 3 residual pages
    assert vars(bm) == before
    with pytest.raises(OutOfPages, match="compressed"):
        bm.append("a", 2)                  # residual fits, but conversion needs a compressed page
    assert vars(bm) == before


def test_errors():
    bm = BlockManager(2, 4, 0, None)
    bm.add_sequence("a")
    with pytest.raises(KvgenRuntimeError, match="already exists"):
        bm.add_sequence("a")
    with pytest.raises(UnknownSequence):
        bm.append("nope", 1)
    with pytest.raises(UnknownSequence):
        bm.free("nope")
    with pytest.raises(KvgenRuntimeError, match="token ids"):
        bm.append("a", 2, [1])
    with pytest.raises(KvgenRuntimeError):
        bm.append("a", -1)
    with pytest.raises(KvgenRuntimeError, match="already exists"):
        bm.fork("a", "a")
    with pytest.raises(KvgenRuntimeError, match="unknown pool"):
        bm.num_free_pages("gpu")
    with pytest.raises(KvgenRuntimeError):
        bm.ref_count(COMPRESSED, 4)
    with pytest.raises(KvgenRuntimeError):
        BlockManager(0, 4, 0, None)
    with pytest.raises(KvgenRuntimeError):
        BlockManager(2, 4, 0, -2)
    assert issubclass(OutOfPages, KvgenRuntimeError) and issubclass(UnknownSequence, KvgenRuntimeError)
    bm.free("a")
    with pytest.raises(UnknownSequence):
        bm.seq_len("a")


def test_page_hash_is_a_sha256_chain():
    first = hashlib.sha256(repr((None, (1, 2), "s")).encode()).hexdigest()
    assert page_hash(None, [1, 2], "s") == first
    assert page_hash(first, (3, 4), "s") == hashlib.sha256(repr((first, (3, 4), "s")).encode()).hexdigest()


def test_two_managers_make_identical_decisions():
    def script(bm: BlockManager) -> list:
        out = []
        for i in range(6):
            out.append(bm.add_sequence(i, [i % 2] * 4))
            out.append(bm.append(i, 5, [i % 2] * 5))
            if i % 3 == 2:
                bm.fork(i, f"f{i}")
                out.append(bm.append(f"f{i}", 3, [1, 1, 1]))
                bm.free(i - 1)
        return out + [bm.block_table(s) for s in bm.sequences()]

    assert script(BlockManager(2, 40, 20, 2, "k")) == script(BlockManager(2, 40, 20, 2, "k"))


def test_runtime_imports_nothing_from_kvgen():
    runtime = Path(__file__).resolve().parents[1] / "kvgen" / "runtime"
    for name in ("block_manager.py", "reservation.py", "errors.py"):
        tree = ast.parse((runtime / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level > 0 or not (node.module or "").startswith("kvgen"), name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvgen") for a in node.names), name


# -- host tier --------------------------------------------------------------------
def test_swap_out_in_shares_each_page_once_and_restores_tables():
    bm = BlockManager(2, 8, 0, None, "s", num_host_pages=8)
    bm.add_sequence("a")
    bm.append("a", 5, [1, 2, 3, 4, 5])     # pages [0, 1, 2]
    bm.fork("a", "b")
    plan = bm.swap_out(["a", "b"])
    # host pages are taken in the sequence's order: device and host runs match (one copy per run)
    assert sorted(plan.to_host) == [(COMPRESSED, 0, 0), (COMPRESSED, 1, 1), (COMPRESSED, 2, 2)]
    assert bm.block_table("a") == bm.block_table("b") == [0, 1, 2]
    assert bm.ref_count(HOST_COMPRESSED, 0) == 2 and bm.num_free_pages(HOST_COMPRESSED) == 5
    # the full pages are prefix-cached: they wait on the LRU list, the tail page is free
    assert bm.num_free_pages(COMPRESSED) == 8 and list(bm._lru) == [1, 0]
    with pytest.raises(SwappedOut, match="swap_in"):
        bm.reserve_step(["a"], [1])
    plan = bm.swap_in(["a", "b"])
    # cached pages come back without a copy; only the tail page is copied, once for both
    assert plan.to_host == [] and [(p, h) for p, h, _ in plan.to_device] == [(COMPRESSED, 2)]
    assert bm.block_table("a") == bm.block_table("b") and bm.block_table("a")[:2] == [0, 1]
    assert bm.ref_count(COMPRESSED, bm.block_table("a")[2]) == 2
    assert bm.num_free_pages(HOST_COMPRESSED) == 8 and bm.host_pages("a") == 0


def test_swap_out_of_one_fork_keeps_the_other_on_the_device():
    bm = BlockManager(2, 8, 0, None, "s", num_host_pages=8)
    bm.add_sequence("a")
    bm.append("a", 4)
    bm.fork("a", "b")
    plan = bm.swap_out(["b"])
    assert len(plan.to_host) == 2 and bm.block_table("a") == [0, 1]
    assert bm.ref_count(COMPRESSED, 0) == 1 and bm.ref_count(HOST_COMPRESSED, plan.to_host[0][2]) == 1


def test_tier_errors_and_out_of_pages_change_nothing():
    bm = BlockManager(2, 4, 0, None, "s")
    bm.add_sequence("a")
    bm.append("a", 4)
    with pytest.raises(KvgenRuntimeError, match="host_tokens"):
        bm.swap_out(["a"])
    bm = BlockManager(2, 4, 0, None, "s", num_host_pages=1)
    bm.add_sequence("a")
    bm.append("a", 4)
    before = copy.deepcopy(vars(bm))
    with pytest.raises(OutOfPages, match="host tier"):
        bm.swap_out(["a"])
    assert vars(bm) == before
    with pytest.raises(KvgenRuntimeError, match="0..2 pages"):
        bm.make_cold("a", 3)
    assert bm.make_cold("a", 1).to_host == [(COMPRESSED, 0, 0)] and bm.host_pages("a") == 1
    with pytest.raises(KvgenRuntimeError, match="already swapped"):
        bm.swap_out(["a"]) if bm.is_swapped("a") else (_ for _ in ()).throw(KvgenRuntimeError("already swapped"))
    bm.add_sequence("b")
    bm.append("b", 6)                      # takes every free device page left
    before = copy.deepcopy(vars(bm))
    with pytest.raises(OutOfPages, match="swapping in"):
        bm.swap_in(["a"])
    assert vars(bm) == before


def test_held_pages_wait_for_release():
    bm = BlockManager(2, 2, 0, None, "s", num_host_pages=4)
    bm.add_sequence("a")
    bm.append("a", 3)
    plan = bm.swap_out(["a"], hold=True)
    assert plan.ticket is not None and bm.num_held_pages() == 2 and bm.num_free_pages(COMPRESSED) == 0
    bm.add_sequence("b")
    with pytest.raises(OutOfPages):
        bm.append("b", 1)
    bm.release_held(plan.ticket)
    assert bm.num_held_pages() == 0 and bm.num_free_pages(COMPRESSED) == 2


def test_pages_a_fork_still_holds_stay_held_until_the_copy_read_them():
    """swap_out(a) copies pages a shares with its fork b; if b is freed before the copy ran, those pages must
    not be handed out (and rewritten) yet. Two swaps reading the same page hold it until both released."""
    bm = BlockManager(2, 4, 0, None, "s", num_host_pages=8)
    bm.add_sequence("a")
    bm.append("a", 4)                      # pages 0, 1
    bm.fork("a", "b")
    first = bm.swap_out(["a"], hold=True)  # reads 0 and 1; b still references them
    assert bm.num_held_pages() == 2
    bm.free("b")
    assert bm.num_free_pages(COMPRESSED) == 2  # 0 and 1 stay out of reach
    bm.release_held(first.ticket)
    assert bm.num_held_pages() == 0 and bm.num_free_pages(COMPRESSED) == 4

    bm.swap_in(["a"])
    bm.fork("a", "c")
    one = bm.swap_out(["a"], hold=True)    # both swaps read a's pages, c's swap releases them
    two = bm.swap_out(["c"], hold=True)
    bm.release_held(one.ticket)
    assert bm.num_held_pages() == 2 and bm.num_free_pages(COMPRESSED) == 2  # the second copy still reads them
    bm.release_held(two.ticket)
    assert bm.num_held_pages() == 0 and bm.num_free_pages(COMPRESSED) == 4


def test_prefix_spill_and_restore():
    bm = BlockManager(2, 3, 0, None, "s", num_host_pages=4)
    bm.add_sequence("a")
    bm.append("a", 4, [1, 2, 3, 4])        # pages 0, 1 cached
    bm.free("a")
    bm.add_sequence("b")
    plan = bm.append("b", 6, [9] * 6)      # needs 3 pages: one free, two evicted -> spilled
    assert [(p, d) for p, d, _ in plan.spills] == [(COMPRESSED, 1), (COMPRESSED, 0)]
    assert bm._hash_page == {} or all(h not in bm._hash_page for h in bm._caches[HOST_COMPRESSED].hash_page)
    bm.free("b")                           # its pages: cached ones to the LRU list
    # without restoring, the prefix is gone from the device
    assert bm.add_sequence("x", [1, 2, 3, 4, 5]) == 0
    bm.free("x")
    host = dict(bm._caches[HOST_COMPRESSED].hash_page)
    hit, plan = bm.add_sequence_plan("c", [1, 2, 3, 4, 5])
    assert hit == 4 and [h for _, h, _ in plan.to_device] == [host[h] for h in bm._seqs["c"].hashes]
    assert bm.block_table("c") == [d for _, _, d in plan.to_device]
    # making room evicted b's cached pages: they spilled first (copies before the restores)
    assert len(plan.to_host) == 2 and {d for _, d, _ in plan.to_host} == set(bm.block_table("c"))
    assert bm.num_free_pages(HOST_COMPRESSED) == 4 and len(bm._caches[HOST_COMPRESSED].hash_page) == 4


@pytest.mark.parametrize("seed", range(12))
def test_reserve_step_decode_shortcut_equals_the_general_path(seed):
    """reserve_step's shortcut for a decode token inside its own unshared tail page leaves every book exactly
    as the general append does -- the same slots, copies, ref counts, free lists, prefix caches (and their
    LRU order), tables, lengths, hashes and pending ids -- over random steps of prefills after prefix hits,
    decodes with and without token ids, forks (shared tail pages), frees and out-of-pages steps (rolled back);
    and the shortcut does run."""
    import random

    rng = random.Random(seed)
    P = rng.choice([3, 4, 16])
    fast, slow = (BlockManager(P, 48, 0, None, "int8") for _ in range(2))
    slow._decode_fast_path = False
    appends = {id(fast): 0, id(slow): 0}
    for bm in (fast, slow):
        general = bm._append

        def counted(*args, bm=bm, general=general):
            appends[id(bm)] += 1
            return general(*args)
        bm._append = counted
    live: list[int] = []
    next_id = 0
    stems = [[rng.randrange(3) for _ in range(2 * P)] for _ in range(3)]  # shared prefixes: prefix-cache hits

    def both(fn):
        outs = []
        for bm in (fast, slow):
            try:
                outs.append(("ok", fn(bm)))
            except OutOfPages as e:
                outs.append(("out", str(e)))
        assert outs[0] == outs[1]
        return outs[0]

    def state(bm):
        pools = {name: (list(p.ref), list(p.free)) for name, p in bm._pools.items()}
        caches = {name: (dict(c.hash_page), dict(c.page_hash), list(c.lru.items())) for name, c in bm._caches.items()}
        seqs = {sid: (s.table.typecode, list(s.table), s.length, s.num_compressed, list(s.hashes), list(s.pending),
                      s.known, s.cold, s.swapped) for sid, s in bm._seqs.items()}
        return pools, caches, seqs, bm._stamp, bm._spills, bm._parked, bm._journal

    for _ in range(200):
        op = rng.random()
        if op < 0.2 or not live:
            sid, next_id = next_id, next_id + 1
            prompt = rng.choice(stems)[:rng.randrange(1, 2 * P)] + [rng.randrange(3) for _ in range(rng.randrange(P))]
            added = both(lambda bm: bm.add_sequence(sid, prompt[:-1]))
            if added[0] == "ok":
                live.append(sid)
                rest = prompt[added[1]:]
                if both(lambda bm: plan_tuple(bm.reserve_step([sid], [len(rest)], [rest])))[0] == "out":
                    gone = live.pop(rng.randrange(len(live)))  # preempt, as the scheduler would
                    both(lambda bm: bm.free(gone))
        elif op < 0.3:
            child, next_id = next_id, next_id + 1
            parent = rng.choice(live)
            both(lambda bm: bm.fork(parent, child))
            live.append(child)
        elif op < 0.4:
            gone = live.pop(rng.randrange(len(live)))
            both(lambda bm: bm.free(gone))
        else:
            batch = rng.sample(live, rng.randrange(1, len(live) + 1))
            ids = [None if rng.random() < 0.2 else [rng.randrange(3)] for _ in batch]
            if both(lambda bm: plan_tuple(bm.reserve_step(batch, [1] * len(batch), ids)))[0] == "out":
                gone = live.pop(rng.randrange(len(live)))
                both(lambda bm: bm.free(gone))
        assert state(fast) == state(slow)
    assert 0 < appends[id(fast)] < appends[id(slow)]  # the shortcut took some appends off the general path


def test_residual_schemes_never_take_the_decode_shortcut():
    """A residual scheme's appends always go through the general path (pages leave its window)."""
    bm = BlockManager(4, 16, 16, 4, "int4")
    calls = []
    general = bm._append
    bm._append = lambda *args: calls.append(1) or general(*args)
    bm.add_sequence("a")
    bm.reserve_step(["a"], [5])
    calls.clear()
    bm.reserve_step(["a"], [1])  # inside its tail page: a non-residual scheme's shortcut case
    assert calls == [1]


def plan_tuple(plan):
    return plan.slots, [(p.start, p.end, list(p.copies), list(p.conversions)) for p in plan.phases]
