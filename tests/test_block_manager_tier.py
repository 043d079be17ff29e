"""BlockManager: the host tier (swap out/in, held pages, prefix spills) and the decode shortcut of reserve_step.

The random state machines over the same books (the tiered ones too) are in test_block_manager.py.
"""

from __future__ import annotations

import copy

import pytest

from kvgen.runtime.block_manager import COMPRESSED, HOST_COMPRESSED, BlockManager
from kvgen.runtime.errors import KvgenRuntimeError, OutOfPages, SwappedOut


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
