"""Scheduler and engine bookkeeping on a real KVCache with a stand-in model (no kernels run)."""

from __future__ import annotations

import random

import pytest

from kvgen.engine import EngineError, SamplingParams

from .helpers import CharTokenizer, TableRunner, all_free, fake_engine, stories_cache


def run_all(engine, max_steps=100000):
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def test_greedy_continuous_batching_chunked_prefill_and_forks():
    cache = stories_cache(4096)
    runner = TableRunner()
    eng = fake_engine(cache, runner, max_num_batched_tokens=24)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(64) for _ in range(rng.randint(1, 60))] for i in range(6)}
    params = SamplingParams(temperature=0, max_tokens=20, n=2)
    # requests arrive at different steps
    for i, (rid, p) in enumerate(prompts.items()):
        eng.add_request(rid, p, params)
        for _ in range(i):
            eng.step()
    done = run_all(eng)
    for rid, p in prompts.items():
        out = done[rid]
        assert [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            assert c.token_ids == runner.greedy(p, 20) and c.finish_reason == "length"
    assert max(t for _, t, _ in runner.steps) <= 24  # the token budget held
    assert any(not d for _, _, d in runner.steps) and any(d for _, _, d in runner.steps)
    assert all_free(cache)


def test_a_long_prompt_is_cut_into_near_equal_chunks():
    from kvgen.engine.scheduler import SHORT_CHUNK_FRACTION, chunk_tokens

    assert [chunk_tokens(n, 24) for n in (0, 1, 24)] == [0, 1, 24]  # what fits goes whole
    assert chunk_tokens(25, 24) == 13 and chunk_tokens(49, 24) == 24  # 13 + 12 (not 24 + 1); 24 + 13 + 12
    assert chunk_tokens(30, 24) == 24  # a last chunk of 6 is long enough: 24 + 6
    assert chunk_tokens(8225, 8181) == 4113  # the H200 case's last two: 4,113 + 4,112, not 8,181 + 44
    for left in range(1, 200):
        for budget in range(1, 40):
            n = chunk_tokens(left, budget)
            assert 1 <= n <= min(left, budget)
            if left > budget:  # never more steps than full chunks take
                assert 1 + -(-(left - n) // budget) == -(-left // budget)
            if budget < left < budget + budget // SHORT_CHUNK_FRACTION:  # the last two differ by one token at most
                assert n - (left - n) in (0, 1)
            elif left > budget:
                assert n == budget
    cache = stories_cache(4096)
    runner = TableRunner()
    eng = fake_engine(cache, runner, max_num_batched_tokens=24)
    prompt = [random.Random(2).randrange(64) for _ in range(50)]  # fed 24, 24 and 2 by full chunks
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3))
    done = run_all(eng)
    assert done["r"].outputs[0].token_ids == runner.greedy(prompt, 3)
    # 50 tokens over a budget of 24: 24 + 13 + 13, then a decode step for each later token
    assert [t for _, t, _ in runner.steps] == [24, 13, 13, 1, 1]
    assert all_free(cache)


def test_preemption_gives_the_same_tokens():
    runner = TableRunner(seed=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40)
    results = []
    for max_tokens in (8192, 160):  # 10 pages of 16: far fewer than 8 sequences of ~80 tokens need
        cache = stories_cache(max_tokens)
        eng = fake_engine(cache, runner)
        ids = [eng.add_request(None, p, params) for p in prompts]
        done = run_all(eng)
        results.append([done[i].outputs[0].token_ids for i in ids])
        assert all_free(cache)
        if max_tokens == 160:
            assert eng.scheduler.num_preemptions > 0
    assert results[0] == results[1] == [runner.greedy(p, 40) for p in prompts]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_does_not_fit_is_retried_only_after_pages_are_freed(async_scheduling):
    """KV-bound: about 2 of 6 long prompts fit at once. The queue's head is offered to the cache again only
    after running sequences free pages, not at every decode step (each offer checks and hashes its whole prompt:
    120 offers here before), and the decode steps while it waits stay asynchronous; the tokens are those of an
    unbounded run."""
    runner = TableRunner(seed=2)
    rng = random.Random(2)
    prompts = [[rng.randrange(64) for _ in range(150)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60)
    cache = stories_cache(2 * 224)  # 28 pages: two sequences of 210 tokens (14 pages each)
    eng = fake_engine(cache, runner, async_scheduling=async_scheduling)
    adds = []
    add = cache.add
    cache.add = lambda *a, **kw: adds.append(a[0]) or add(*a, **kw)
    ids = [eng.add_request(None, p, params) for p in prompts]
    done = run_all(eng)
    assert [done[i].outputs[0].token_ids for i in ids] == [runner.greedy(p, 60) for p in prompts]
    assert eng.peak_running <= 3 and eng.num_decode_steps >= 3 * 50
    # each request admitted once and again after each preemption, plus at most one failed offer per finish
    assert len(set(adds)) == 6 and len(adds) <= 6 + eng.scheduler.num_preemptions + 6
    if async_scheduling:
        assert eng.num_async_steps >= 3 * 50  # decode ran on while the head waited
    assert all_free(cache)


def test_prefix_reuse_skips_cached_pages():
    cache = stories_cache(4096)
    runner = TableRunner()
    eng = fake_engine(cache, runner)
    prompt = list(range(40))
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=4))
    run_all(eng)
    eng.add_request("b", prompt + [5, 6], SamplingParams(temperature=0, max_tokens=4))
    out = run_all(eng)["b"]
    assert out.num_cached_tokens == 32  # two full 16-token pages of the shared prompt
    assert out.outputs[0].token_ids == runner.greedy(prompt + [5, 6], 4)
    assert all_free(cache)


def test_stop_conditions_and_abort():
    cache = stories_cache(4096)
    runner = TableRunner(seed=2)
    eng = fake_engine(cache, runner, tokenizer=CharTokenizer(), eos_token_ids=())
    prompt = [3, 9, 27]
    ref = runner.greedy(prompt, 30)
    text = CharTokenizer().decode(ref)
    eng.add_request("ids", prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ref[5]]))
    stop = text[6:8]
    eng.add_request("str", prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    eng.add_request("min", prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=12,
                                                  stop_token_ids=[ref[5]]))
    eng.add_request("abort", prompt, SamplingParams(temperature=0, max_tokens=30))
    eng.step()
    eng.abort_request("abort")
    done = run_all(eng)
    k = ref.index(ref[5])
    assert done["ids"].outputs[0].token_ids == ref[:k + 1] and done["ids"].outputs[0].stop_reason == ref[5]
    s = done["str"].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and s.text == text[:text.index(stop)]
    m = done["min"].outputs[0]
    assert len(m.token_ids) >= 12 and (m.finish_reason == "length" or m.token_ids[-1] == ref[5])
    assert m.token_ids[:12] != ref[:12] or ref[5] not in ref[:11]  # the stop id was masked before min_tokens
    assert "abort" not in done and all_free(cache)


def test_max_model_len_and_bad_requests():
    cache = stories_cache(4096)
    eng = fake_engine(cache, max_model_len=20)
    with pytest.raises(EngineError, match="max_model_len"):
        eng.add_request(None, list(range(20)))
    with pytest.raises(EngineError, match="token ids"):
        eng.add_request(None, [1, 2, 999])
    with pytest.raises(EngineError, match="tokenizer"):
        eng.add_request(None, "text")
    eng.add_request("x", list(range(15)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    out = run_all(eng)["x"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(EngineError, match="max_num_seqs"):
        eng.add_request(None, [1, 2], SamplingParams(n=9))
    with pytest.raises(EngineError):
        SamplingParams(top_p=0)


def test_thousand_random_requests_leave_every_page_free():
    cache = stories_cache(640)  # 40 pages: constant preemption
    runner = TableRunner(seed=3)
    eng = fake_engine(cache, runner, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=128)
    rng = random.Random(3)
    shared = [rng.randrange(64) for _ in range(40)]
    pending = 1000
    live: list[str] = []
    finished = aborted = 0
    steps = 0
    while pending or eng.has_unfinished_requests():
        for _ in range(rng.randint(0, 6) if pending else 0):
            n = rng.randint(1, 40)
            prompt = (shared[:rng.randint(0, 40)] + [rng.randrange(64) for _ in range(n)])[:100]
            params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 24),
                                    n=rng.choice([1, 1, 2, 3]), seed=rng.choice([None, 5]))
            live.append(eng.add_request(None, prompt, params))
            pending -= 1
            if not pending:
                break
        if live and rng.random() < 0.1:
            eng.abort_request(live.pop(rng.randrange(len(live))))
            aborted += 1
        for out in eng.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
                assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
        steps += 1
        assert len(cache.sequences()) == len(eng.scheduler.running) <= 16
    assert finished + aborted == 1000 and eng.scheduler.num_preemptions > 0
    assert all_free(cache)
