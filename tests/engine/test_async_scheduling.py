"""Async scheduling (decode step n+1 planned while step n runs) gives the tokens of the synchronous engine.

The stand-in runner (no kernels) drives a long random run -- arrivals,
aborts, stops, forks, preemption -- in both modes; stories260K on the
interpreter checks the real model path (input ids fed from the device,
CUDA-graph static buffers run uncaptured) at small sizes.
"""

from __future__ import annotations

import random

import pytest

from kvgen.engine import SamplingParams
from kvgen.engine.errors import EngineError
from kvgen.engine.sequence import Status

from .helpers import STORIES, CharTokenizer, TableRunner, all_free, fake_engine, stories_cache


def held_pages_match(eng) -> bool:
    """The cache holds exactly the running sequences and the finished rows of the step in flight."""
    cur = eng._inflight
    zombies = [] if cur is None else cur.zombies
    live = {s.seq_id for s in eng.scheduler.running} | {s.seq_id for s in eng.scheduler.waiting
                                                        if s.status is Status.SWAPPED}
    return set(eng.cache.sequences()) == live | {s.seq_id for s in zombies} and not live & {z.seq_id for z in zombies}


def random_events(seed: int, calls: int, vocab: int = 64):
    """Per engine call: the requests that arrive (id, prompt, params) and the ids aborted; fixed in advance."""
    rng = random.Random(seed)
    events = []
    k = 0
    for t in range(calls):
        arrive = []
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2]) if t < calls - 60 else 0):
            shared = list(range(20))[:rng.choice([0, 0, 16, 20])]  # some prompts share a full page
            prompt = (shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 24))])
            seeded = rng.random() < 0.3
            params = SamplingParams(
                temperature=0.9 if seeded else 0, seed=rng.randrange(100) if seeded else None,
                max_tokens=rng.randint(1, 30), min_tokens=rng.choice([0, 0, 3]), n=rng.choice([1, 1, 1, 2]),
                stop_token_ids=rng.sample(range(vocab), rng.choice([0, 0, 1, 2])),
                stop=rng.choice([[], [], ["ab"], ["q", "zz"]]), ignore_eos=rng.random() < 0.5,
                repetition_penalty=rng.choice([1.0, 1.0, 1.3]), logprobs=rng.choice([None, None, 2]))
            arrive.append((f"r{k}", prompt, params))
            k += 1
        abort = [f"r{rng.randrange(k)}"] if k and rng.random() < 0.05 else []
        events.append((arrive, abort))
    return events


def drive(async_on: bool, events, max_tokens: int = 256):
    cache = stories_cache(max_tokens)  # 16 pages of 16: frequent preemption
    runner = TableRunner(seed=5)
    eng = fake_engine(cache, runner, tokenizer=CharTokenizer(), eos_token_ids=(7,), max_num_seqs=8,
                      max_num_batched_tokens=40, max_model_len=96, async_scheduling=async_on)
    done, aborted = {}, set()
    calls = 0
    for arrive, abort in events:
        for rid, prompt, params in arrive:
            eng.add_request(rid, prompt, params)
        for rid in abort:
            req = eng.requests.get(rid)
            if req is not None:
                eng.abort_request(rid)
                done[rid] = eng.output_of(req)
                aborted.add(rid)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        calls += 1
        assert held_pages_match(eng)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        calls += 1
        assert held_pages_match(eng)
    assert eng._inflight is None and all_free(cache), "pages leaked"
    return eng, done, aborted


def completions(out):
    return [(c.index, c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in out.outputs]


def test_long_random_run_equals_the_synchronous_engine_and_frees_every_page():
    events = random_events(0, 560)
    sync_eng, sync, sync_aborted = drive(False, events)
    async_eng, asyn, async_aborted = drive(True, events)
    assert sync.keys() == asyn.keys() and len(sync) > 150
    # under this much page pressure many steps fall back (a waiting request may fit); a third still overlap
    assert async_eng.num_async_steps > 0.3 * async_eng.num_steps
    assert sync_eng.num_async_steps == 0
    assert sync_eng.scheduler.num_preemptions > 0 and async_eng.scheduler.num_preemptions > 0
    finish = {c.finish_reason for o in sync.values() for c in o.outputs}
    assert {"stop", "length", "abort"} <= finish
    exact = 0
    for rid, out in sync.items():
        if rid in sync_aborted or rid in async_aborted:
            # aborted at the same call, but async runs a step behind: the same stream, cut elsewhere
            for a, b in zip(sorted(out.outputs, key=lambda c: c.index),
                            sorted(asyn[rid].outputs, key=lambda c: c.index)):
                m = min(len(a.token_ids), len(b.token_ids))
                assert a.token_ids[:m] == b.token_ids[:m], rid
            continue
        assert completions(out) == completions(asyn[rid]), rid
        exact += 1
    assert exact > 100


def test_finishes_at_different_steps_free_rows_after_the_step_in_flight():
    """Requests stopping by stop id, stop string, max_tokens and abort, each at its own step."""
    runner = TableRunner(seed=2)
    prompt = [3, 9, 27]
    ref = runner.greedy(prompt, 30)
    text = CharTokenizer().decode(ref)
    results = []
    for async_on in (False, True):
        cache = stories_cache(4096)
        eng = fake_engine(cache, runner, tokenizer=CharTokenizer(), eos_token_ids=(), async_scheduling=async_on)
        eng.add_request("ids", prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ref[5]]))
        eng.add_request("str", prompt, SamplingParams(temperature=0, max_tokens=30, stop=[text[8:10]]))
        eng.add_request("len", prompt, SamplingParams(temperature=0, max_tokens=3))
        eng.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=25))
        eng.add_request("abort", prompt, SamplingParams(temperature=0, max_tokens=30))
        done = {}
        for i in range(200):
            if i == 12:
                eng.abort_request("abort")
                if async_on:  # its row is still in the step in flight: its pages wait for that step
                    assert ("abort", 0) in cache.sequences()
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
            assert held_pages_match(eng)
            if not eng.has_unfinished_requests():
                break
        assert eng._inflight is None and all_free(cache)
        results.append({r: completions(o) for r, o in done.items()})
        assert done["long"].outputs[0].token_ids == ref[:25]
        if async_on:
            assert eng.num_async_steps >= 15
    assert results[0] == results[1]


def test_abort_of_the_last_request_drains_the_step_in_flight():
    cache = stories_cache(4096)
    eng = fake_engine(cache, async_scheduling=True)
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None
    eng.abort_request("a")
    assert eng._inflight is None and not eng.has_unfinished_requests() and all_free(cache)


def test_toggling_async_scheduling_off_drains_and_reports_the_tokens():
    runner = TableRunner(seed=4)
    cache = stories_cache(4096)
    eng = fake_engine(cache, runner, async_scheduling=True)
    eng.add_request("a", [5, 6], SamplingParams(temperature=0, max_tokens=12))
    for _ in range(6):
        eng.step()
    eng.async_scheduling = False
    assert eng._inflight is None
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == runner.greedy([5, 6], 12)
    assert all_free(cache)


def test_prompt_pages_still_hit_the_prefix_cache():
    """Async steps reserve without token ids: generated pages are not registered, prompt pages are."""
    runner = TableRunner()
    cache = stories_cache(4096)
    eng = fake_engine(cache, runner, async_scheduling=True)
    prompt = list(range(40))
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=30))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_async_steps > 20
    out_a = runner.greedy(prompt, 30)
    # the prompt's two full pages hit; the page the generated tokens completed (prompt[32:40] + 8 outputs)
    # was filled by async steps, so it is not cached
    eng.add_request("b", prompt + out_a, SamplingParams(temperature=0, max_tokens=4))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["b"].num_cached_tokens == 32
    assert done["b"].outputs[0].token_ids == runner.greedy(prompt + out_a, 4)
    assert all_free(cache)


class ListRunner(TableRunner):
    device_input_ids = False  # token ids from the host only (as tensor-parallel ranks)


def test_async_scheduling_where_it_cannot_run_is_refused_by_the_engine():
    """Asked for where it cannot run, async scheduling raises (as vLLM's async_scheduling=True) instead of
    quietly running synchronously: at construction and from the setter, which then changes nothing."""
    with pytest.raises(EngineError, match="ListRunner takes them from the host"):
        fake_engine(stories_cache(4096), ListRunner(), async_scheduling=True)
    eng = fake_engine(stories_cache(4096), ListRunner())
    with pytest.raises(EngineError, match="tp=1"):
        eng.async_scheduling = True
    assert not eng.async_scheduling
    eng.async_scheduling = False  # turning it off is always fine
    eng.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=8))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.num_async_steps == 0 and eng._inflight is None and all_free(eng.cache)

    tiered = fake_engine(stories_cache(160, host_tokens=256))
    with pytest.raises(EngineError, match="host tier"):
        tiered.async_scheduling = True
    assert not tiered.async_scheduling


@pytest.mark.parametrize("kwargs", [dict(tp=2), dict(host_tokens=256)], ids=["tp2", "host_tier"])
def test_build_engine_refuses_async_scheduling_before_loading(monkeypatch, kwargs):
    """The same refusal as the engine's, raised before planning, compiling or starting any rank."""
    import kvgen.integrations.transformers as integration
    from kvgen.engine.loader import build_engine

    def loaded(*args, **kw):
        raise AssertionError("build_engine went on to plan the cache")

    monkeypatch.setattr(integration, "plan_for_model", loaded)
    config = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with pytest.raises(EngineError, match="host tier" if "host_tokens" in kwargs else "tp=1"):
        build_engine(config=config, device="cpu", verbose=False, async_scheduling=True, **kwargs)


# -- stories260K through the interpreter ------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw a big red ball. He", "Lily"]


@pytest.fixture(scope="module")
def llm():
    from kvgen.engine.llm import LLM

    return LLM(str(STORIES), kv="fp32", max_tokens=2048, max_num_seqs=8, verbose=False)


def staggered(engine, prompts, params, abort_at=None):
    """Prompt i joins at call 2*i; ``abort_at = (call, index)`` aborts one. Returns completions by prompt."""
    ids, done, call = {}, {}, 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if i not in ids and call >= 2 * i:
                ids[i] = engine.add_request(None, p, params[i])
        if abort_at is not None and call == abort_at[0]:
            req = engine.requests[ids[abort_at[1]]]
            engine.abort_request(req.request_id)
            done[req.request_id] = engine.output_of(req)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        call += 1
    return [completions(done[ids[i]]) for i in range(len(prompts))]


def test_stories_staggered_forks_and_stops_equal_the_synchronous_engine(llm):
    eng = llm.engine
    tok = llm.get_tokenizer()
    eng.async_scheduling = False
    plain = staggered(eng, PROMPTS, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3)
    ref0, ref2 = plain[0][0][1], plain[2][0][1]
    stop_text = tok.decode(ref2[4:6], skip_special_tokens=True).strip()[:3]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[ref0[6]]),
              SamplingParams(temperature=0, max_tokens=9, n=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_text])]
    results = []
    for async_on in (False, True):
        eng.async_scheduling = async_on
        steps = eng.num_async_steps
        results.append(staggered(eng, PROMPTS, params))
        assert all_free(eng.cache) and eng._inflight is None
        if async_on:
            assert eng.num_async_steps - steps >= 5
    eng.async_scheduling = False
    assert results[0] == results[1]
    first, forks, stopped = results[1]
    assert first[0][1] == ref0[:ref0.index(ref0[6]) + 1] and first[0][2] == "stop"
    assert len(forks) == 2 and forks[0][1] == forks[1][1] == plain[1][0][1][:9]
    assert stopped[0][2] == "stop" and len(stopped[0][1]) < 12


def test_stories_abort_mid_run(llm):
    eng = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    results = []
    for async_on in (False, True):
        eng.async_scheduling = async_on
        results.append(staggered(eng, PROMPTS, params, abort_at=(7, 0)))
        assert all_free(eng.cache) and eng._inflight is None
    eng.async_scheduling = False
    (a_sync, *rest_sync), (a_async, *rest_async) = results
    assert rest_sync == rest_async
    m = min(len(a_sync[0][1]), len(a_async[0][1]))
    assert a_sync[0][2] == a_async[0][2] == "abort" and m >= 3 and a_sync[0][1][:m] == a_async[0][1][:m]


def test_stories_tiny_page_budget_and_graph_buffers_equal_the_synchronous_engine():
    """Preemption under a tiny page budget (int4: page conversions in the static-buffer graph path)."""
    from kvgen.engine.graphs import DecodeGraphs
    from kvgen.engine.llm import LLM

    results = []
    for async_on in (False, True):
        small = LLM(str(STORIES), kv="int4", max_tokens=64, max_model_len=64, max_num_seqs=4, verbose=False,
                    async_scheduling=async_on)
        eng = small.engine
        if async_on:  # the graph path's static buffers (uncaptured): ids copied device to device
            eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, 4, eng.max_model_len, capture=False)
        outs = small.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        results.append([completions(o) for o in outs])
        assert eng.scheduler.num_preemptions > 0 and all_free(eng.cache)
        if async_on:
            assert eng.num_async_steps > 0 and eng.runner.graph_steps > 0
    assert results[0] == results[1]


# -- the GPU (KVGEN_TEST_DEVICE=cuda pytest -m gpu tests/engine/test_async_scheduling.py) -------------------

TINY = dict(model_type="llama", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_theta=500000.0, tie_word_embeddings=False)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["bf16", "int4"])
def test_gpu_graph_decode_async_equals_sync(kv):
    """Captured CUDA graphs, ids copied device to device, page conversions (int4) in the replayed steps.

    One batch that starts and ends together: every step's batch is the same
    in both modes (a finished row riding along one more step would change
    the graph bucket, and bf16 GEMMs are not batch-invariant).
    """
    import torch

    from kvgen.engine.loader import build_engine

    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    results = []
    for async_on in (False, True):
        eng = build_engine(config=TINY, kv=kv, dtype="bfloat16", device="cuda", max_model_len=1024,
                           max_num_seqs=16, max_tokens=16384, autotune=False, verbose=False,
                           async_scheduling=async_on)
        ids = [eng.add_request(None, p, params) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        torch.cuda.synchronize()
        results.append([done[i] for i in ids])
        assert eng.runner.graph_steps > 50 and all_free(eng.cache)
        if async_on:
            assert eng.num_async_steps >= 60
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gpu_random_run_async_finishes_everything_and_frees_every_page():
    """Arrivals, stops, aborts and preemption with graphs and async scheduling: no leak, no stuck request."""
    from kvgen.engine.loader import build_engine

    eng = build_engine(config=TINY, kv="int4", dtype="bfloat16", device="cuda", max_model_len=512,
                       max_num_seqs=16, max_tokens=2048, autotune=False, verbose=False, async_scheduling=True)
    rng = random.Random(1)
    live, finished, stops = [], 0, {}
    for call in range(600):
        if call < 500:
            for _ in range(rng.choice([0, 0, 1, 2])):
                p = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 80),
                                   stop_token_ids=rng.sample(range(1024), 3), ignore_eos=True)
                live.append(eng.add_request(None, [rng.randrange(1024) for _ in range(rng.randint(1, 200))], p))
                stops[live[-1]] = p.stop_token_ids
        if live and rng.random() < 0.03:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        for out in eng.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
                c = out.outputs[0]
                assert c.finish_reason == "length" or c.token_ids[-1] in stops[out.request_id]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished += 1
    assert finished > 100 and eng.num_async_steps > 100 and eng.scheduler.num_preemptions > 0
    assert eng._inflight is None and all_free(eng.cache)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampled", [False, True])
def test_gpu_steady_async_steps_never_wait_for_the_device_but_for_their_draws(sampled):
    """Between steady async steps the host waits only for the previous step's draws (an event): no
    pageable upload, .tolist() or .item() -- each would wait for the next step too, launched just before,
    and the planning would no longer overlap the device. Checked by torch's sync debug mode."""
    import torch

    from kvgen.engine.loader import build_engine

    eng = build_engine(config=TINY, kv="bf16", dtype="bfloat16", device="cuda", max_model_len=1024,
                       max_num_seqs=16, max_tokens=16384, autotune=False, verbose=False, async_scheduling=True)
    if sampled:
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                presence_penalty=0.2, frequency_penalty=0.1, max_tokens=200, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    rng = random.Random(3)
    for _ in range(8):
        eng.add_request(None, [rng.randrange(1024) for _ in range(rng.randint(20, 300))], params)
    for _ in range(20):  # prefill, then steady decode with its graphs replaying
        eng.step()
    a0, g0 = eng.num_async_steps, eng.runner.graph_steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.num_async_steps - a0 == 30 and eng.runner.graph_steps - g0 == 30
