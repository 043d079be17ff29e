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
from kvgen.engine.parallel import RecordingCache, replay
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


def test_llm_with_a_host_tier_swaps_and_gives_the_same_greedy_tokens():
    """stories260K (interpreter): 4 device pages, a host tier; the tokens equal an unpressured run's."""
    from kvgen.engine.llm import LLM

    prompts = ["Once upon a time", "The sun", "Lily"]
    params = [SamplingParams(temperature=0, max_tokens=10, min_tokens=10, n=2 if i == 1 else 1) for i in range(3)]
    big = LLM(str(STORIES), kv="fp32", max_tokens=1024, max_model_len=64, max_num_seqs=4, verbose=False)
    want = [[c.token_ids for c in o.outputs] for o in big.generate(prompts, params)]
    assert big.engine.scheduler.num_preemptions == 0
    small = LLM(str(STORIES), kv="fp32", max_tokens=48, max_model_len=48, max_num_seqs=4, host_tokens=256,
                verbose=False)
    got = [[c.token_ids for c in o.outputs] for o in small.generate(prompts, params)]
    sched = small.engine.scheduler
    assert got == want and len(got[1]) == 2
    assert sched.preemption_mode == "swap" and sched.num_swapped_out > 0 and sched.num_swapped_in > 0
    assert all_free(small.engine.cache)


def test_runner_runs_eagerly_right_after_a_swap_and_graphs_refuse_cold_steps():
    import types

    import torch

    from kvgen.engine.graphs import DecodeGraphs
    from kvgen.engine.runner import ModelRunner

    class Graphs:
        def __init__(self):
            self.replays = 0

        def can_run(self, step):
            return True

        def run(self, step, ids, pos):
            self.replays += 1
            return torch.zeros(len(ids), 2)

    model = lambda ids, pos, attend: torch.zeros(len(ids), 2)  # noqa: E731
    graphs = Graphs()
    runner = ModelRunner(model, types.SimpleNamespace(device=torch.device("cpu")), graphs)
    step = types.SimpleNamespace(is_decode=True)
    runner.run(step, [1], [0], [])
    runner.eager_once()
    runner.run(step, [1], [1], [])
    runner.run(step, [1], [2], [])
    assert (graphs.replays, runner.graph_steps, runner.eager_steps) == (2, 2, 1)
    # a step with cold pages (staged inside the layer loop) never replays a graph
    fake = types.SimpleNamespace(is_decode=True, batch=1, num_copies=0, num_conversions=0, phases=[0], max_pages=1,
                                 cold=None)
    dg = types.SimpleNamespace(max_batch=4, residual=False, max_pages=4)
    assert DecodeGraphs.can_run(dg, fake)
    fake.cold = object()
    assert not DecodeGraphs.can_run(dg, fake)


def test_a_mirror_cache_replays_swaps_identically():
    """tp's replay: a worker's cache (with its own host tier) follows rank 0's swaps step for step."""
    from .test_tensor_parallel_units import ReplayingRunner

    main = stories_cache(160, max_seqs=8, host_tokens=1024)
    mirror = stories_cache(160, max_seqs=8, host_tokens=1024)
    runner = ReplayingRunner(mirror)
    recorder = runner.recorder = RecordingCache(main)
    eng = fake_engine(recorder, runner)
    prompts, params = workload(4)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    eng.abort_request(ids[-1])
    done = run_all(eng)
    for i, p, sp in zip(ids[:-1], prompts, params):
        assert [c.token_ids for c in done[i].outputs] == [runner.greedy(p, 30)] * sp.n
    assert runner.calls.get(("swap_out", False), 0) > 0 and runner.calls.get(("swap_in", False), 0) > 0
    assert runner.compared > 0
    replay(mirror, recorder.take())  # the frees after the last step
    assert all_free(main) and all_free(mirror)


def test_cli_host_tokens_flag():
    import argparse

    from kvgen.engine import cli

    p = argparse.ArgumentParser()
    cli.add_args(p)
    base = ["--model", "m", "--prompt", "x"]
    assert p.parse_args(base).host_tokens is None
    assert p.parse_args(base + ["--host-tokens", "4096"]).host_tokens == 4096
    assert p.parse_args(base + ["--host-tokens", "plan"]).host_tokens == "plan"
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--host-tokens", "-3"])
