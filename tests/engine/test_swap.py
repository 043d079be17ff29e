"""Preemption by swap: a cache with a host tier sends preempted sequences' pages there and back.

Scheduler tests use the stand-in runner over a real KVCache (every swap goes
through the block manager and the host pool's copies); one test runs the real
model (stories260K, interpreter) to show the tokens survive the round trip.
"""

from __future__ import annotations

import pickle
import random

import pytest

from kvgen.engine import EngineError, SamplingParams
from kvgen.engine.parallel import RecordingCache
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import Status

from .helpers import STORIES, TableRunner, all_free, fake_engine, stories_cache
from .test_scheduler import run_all


def swap_calls(recorder: RecordingCache) -> list[tuple[str, tuple, bool]]:
    """(name, seq ids, failed) of the swap calls recorded so far (drains the recorder)."""
    out = []
    for op, failed in recorder.take():
        name, args, _ = pickle.loads(op)
        if name in ("swap_out", "swap_in"):
            out.append((name, tuple(args[0]), failed is not None))
    return out


def workload(seed: int = 1):
    rng = random.Random(seed)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=30, n=2 if i % 3 == 1 else 1) for i in range(8)]
    return prompts, params


def test_swap_preemption_gives_the_same_tokens_and_frees_every_tier():
    """10 device pages for 8 requests (some n=2) of ~70 tokens: preempted by swap, same greedy tokens."""
    runner = TableRunner(seed=1)
    prompts, params = workload()
    results = []
    for max_tokens, host in ((8192, None), (160, 2048)):
        cache = stories_cache(max_tokens, **({} if host is None else {"host_tokens": host}))
        rec = RecordingCache(cache)
        eng = fake_engine(rec, runner)
        assert eng.scheduler.preemption_mode == ("recompute" if host is None else "swap")
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        calls, done = [], {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o for o in eng.step() if o.finished})
            calls += swap_calls(rec)
        results.append([[c.token_ids for c in done[i].outputs] for i in ids])
        assert all_free(cache)
        if host is not None:
            sched = eng.scheduler
            assert sched.num_swapped_out > 0 and sched.num_swapped_in == sched.num_swapped_out
            outs = [c for c in calls if c[0] == "swap_out" and not c[2]]
            assert len(outs) > 0 and sum(len(c[1]) for c in outs) == sched.num_swapped_out
            # a fork group (both completions of an n=2 request) went out in one call and came back
            assert any(len(c[1]) == 2 and c[1][0][0] == c[1][1][0] for c in outs)
    for p, sp, got, want in zip(prompts, params, *results):
        assert got == want == [runner.greedy(p, 30)] * sp.n


def test_a_full_host_tier_falls_back_to_recompute():
    """One host page: most swaps fail (all or nothing) and the victim is recomputed; tokens unchanged."""
    runner = TableRunner(seed=2)
    prompts, params = workload(2)
    cache = stories_cache(160, host_tokens=16)
    eng = fake_engine(cache, runner)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = run_all(eng)
    for i, p, sp in zip(ids, prompts, params):
        assert [c.token_ids for c in done[i].outputs] == [runner.greedy(p, 30)] * sp.n
    assert eng.scheduler.num_swap_failures > 0
    assert all_free(cache)


def test_aborting_a_swapped_request_frees_its_host_pages():
    runner = TableRunner(seed=3)
    prompts, params = workload(3)
    cache = stories_cache(160, host_tokens=2048)
    bm = cache.block_manager
    eng = fake_engine(cache, runner)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    swapped = None
    for _ in range(1000):
        eng.step()
        swapped = next((s for s in eng.scheduler.waiting if s.status is Status.SWAPPED), None)
        if swapped is not None:
            break
    assert swapped is not None
    rid = swapped.request.request_id
    held = bm.host_pages(swapped.seq_id)
    assert held > 0 and bm.is_swapped(swapped.seq_id)
    free_before = bm.num_free_pages("host_compressed")
    eng.abort_request(rid)
    assert bm.num_free_pages("host_compressed") >= free_before + 1
    assert swapped.seq_id not in cache.sequences() and swapped.status is Status.FINISHED
    assert all(s not in eng.scheduler.waiting for s in swapped.request.seqs)
    done = run_all(eng)
    for i, p, sp in zip(ids, prompts, params):
        if i != rid:
            assert [c.token_ids for c in done[i].outputs] == [runner.greedy(p, 30)] * sp.n
    assert all_free(cache)


def test_preemption_mode_checks():
    cache = stories_cache(160)
    with pytest.raises(EngineError, match="host tier"):
        Scheduler(cache, 4, 64, "swap")
    with pytest.raises(EngineError, match="preemption_mode"):
        Scheduler(cache, 4, 64, "evict")
    tiered = stories_cache(160, host_tokens=256)
    assert Scheduler(tiered, 4, 64).preemption_mode == "swap"
    assert Scheduler(tiered, 4, 64, "recompute").preemption_mode == "recompute"
