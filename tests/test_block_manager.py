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

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.runtime.block_manager import (COMPRESSED, HOST, HOST_COMPRESSED, HOST_RESIDUAL, RESIDUAL, AppendPlan,
                                         BlockManager)
from kvgen.runtime.errors import OutOfPages, SwappedOut

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
