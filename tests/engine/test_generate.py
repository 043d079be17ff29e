"""stories260K end to end on the runtime (kernels in the Triton interpreter): the engine equals HF greedy.

Interpreter cost sets the sizes: a decode step costs ~0.25 s of CPU per
sequence (10 interpreted launches), so CI runs 10 tokens of 5 prompts (7
completions with forks); the issue's 16 prompts x 200 tokens is ``slow``.
"""

from __future__ import annotations

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvgen.engine import EngineError, SamplingParams  # noqa: E402
from kvgen.engine.llm import LLM  # noqa: E402

from .helpers import STORIES, all_free  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw a big red ball. He", "Lily",
           "One day, a boy named Tim went to the store with his mom. They wanted to buy", "The sun"]


@pytest.fixture(scope="module")
def hf():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(STORIES)

    def greedy(prompt: str, n: int) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    greedy.tok = tok
    return greedy


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES), kv="fp32", max_tokens=2048, max_num_seqs=8, verbose=False)


def greedy_params(n_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens, n=n)


def run_staggered(engine, prompts, n_tokens):
    """Prompt i joins at step 2*i; odd prompts fork into n = 2 completions. Returns outputs by prompt."""
    ids, done, step = {}, {}, 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if i not in ids and step >= 2 * i:
                ids[i] = engine.add_request(None, p, greedy_params(n_tokens, n=1 + i % 2))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[ids[i]] for i in range(len(prompts))]


def check_against_hf(outs, prompts, hf, n_tokens):
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf(p, n_tokens)
        assert len(out.outputs) == 1 + i % 2
        for c in out.outputs:
            assert c.token_ids == ref, (p, c.token_ids, ref)
            assert c.finish_reason == "length"
            assert c.text == hf.tok.decode(ref, skip_special_tokens=True)


def test_staggered_greedy_with_forks_equals_hf(llm, hf):
    outs = run_staggered(llm.engine, PROMPTS, 10)
    check_against_hf(outs, PROMPTS, hf, 10)
    assert llm.engine.runner.eager_steps > 0 and all_free(llm.engine.cache)


@pytest.mark.slow
def test_sixteen_prompts_two_hundred_tokens_equal_hf(llm, hf):
    prompts = [" ".join(["Once upon a time there was a"] * (1 + i % 5))[: 8 + 9 * i] for i in range(16)]
    outs = run_staggered(llm.engine, prompts, 200)
    check_against_hf(outs, prompts, hf, 200)
    assert all_free(llm.engine.cache)


def test_generate_under_a_tiny_page_budget_preempts_and_gives_the_same_tokens(hf):
    small = LLM(str(STORIES), kv="fp32", max_tokens=64, max_model_len=64, max_num_seqs=4, verbose=False)
    prompts = PROMPTS[:3]
    outs = small.generate(prompts, greedy_params(14))
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf(p, 14)
    assert small.engine.scheduler.num_preemptions > 0
    assert all_free(small.engine.cache)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.5, max_tokens=6, seed=11)
    a = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    b, _ = llm.generate(["Once upon a time", "The sun"], [params, SamplingParams(temperature=1.0, max_tokens=6)])
    c = llm.generate("Once upon a time", SamplingParams(temperature=1.5, max_tokens=6, seed=12))[0]
    assert a == b.outputs[0].token_ids
    assert c.outputs[0].token_ids != a


def test_stream_and_chat(llm, hf):
    outs = list(llm.stream("Lily", greedy_params(5)))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert outs[-1].outputs[0].token_ids == hf("Lily", 5)
    with pytest.raises(EngineError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("extra", [[], ["--async-scheduling"]])
def test_kvgen_generate_streams_hf_greedy_text(hf, capsys, extra):
    from kvgen.engine import cli

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(["--model", str(STORIES), "--kv", "fp32", "--prompt", "Once upon a time",
                              "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--cache-tokens", "1024",
                              *extra])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    ids = hf("Once upon a time", 8)
    assert out == hf.tok.decode(ids, skip_special_tokens=True) + "\n"


def test_random_weight_engine_from_a_config():
    from kvgen.engine.loader import build_engine

    config = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    eng = build_engine(config=config, kv="int8", max_num_seqs=2, verbose=False)
    assert eng.plan.model == "random-qwen3" and eng.model_config.qk_norm and eng.max_model_len == 64
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.add_request("b", [4, 5], SamplingParams(temperature=0.9, max_tokens=2, ignore_eos=True, seed=1))
    lengths = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
    assert lengths == {"a": 3, "b": 2} and all_free(eng.cache)


def test_graph_path_static_buffers_give_the_same_tokens(monkeypatch):
    """The CUDA-graph step's static buffers (padding rows, in-graph page conversions for int4) run eagerly
    on the CPU: tokens equal the runtime's own decode path. The graphs' decode config is the runtime's
    (kernel_config at the bucket's batch and the longest context); here it asks for 3 splits, so the
    kernel's in-launch combine runs too (the CPU default is one split)."""
    from kvgen.engine.graphs import DecodeGraphs

    prompts = ["Once upon a time there was a", "The sun", "Lily and Tom went to the"]  # pages fill mid-run
    results = []
    for graphs in (False, True):
        small = LLM(str(STORIES), kv="int4", max_tokens=1024, max_num_seqs=4, verbose=False)
        eng = small.engine
        asked, given = [], []
        if graphs:
            eng.cache.kernel_config = lambda op, shape: asked.append((op, shape)) or {"num_splits": 3,
                                                                                      "pages_per_tile": 1}
            decode = eng.cache.kernels["decode"]
            launch = decode.launch
            monkeypatch.setattr(decode, "launch", lambda *a, **kw: given.append(kw.get("counters")) or launch(*a, **kw))
            eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, 4, eng.max_model_len, capture=False)
        results.append([o.outputs[0].token_ids for o in small.generate(prompts, greedy_params(10))])
        if graphs:
            assert eng.runner.graph_steps >= 8 and eng.runner.graphs.converted_steps > 0
            longest = eng.runner.graphs.max_pages * eng.cache.page_size
            assert {op for op, _ in asked} == {"decode"} and {s[1] for _, s in asked} == {longest}
            assert {s[0] for _, s in asked} >= {4}
            # the graphs' own counters (a captured graph keeps their address), left zero by the split launches
            own = eng.runner.graphs.counters
            assert given and all(c is own for c in given) and int(own.count_nonzero()) == 0
            monkeypatch.undo()
        assert all_free(eng.cache)
    assert results[0] == results[1]


def test_runner_uploads_leave_the_planned_step_alone():
    """The runner's ids and positions go up through a DeviceBuffers of its own: they arrive as given, and the
    step's metadata the cache uploaded just before (its int64 slot mapping too) stays as planned."""
    from kvgen.engine.runner import ModelRunner

    from .helpers import stories_cache

    cache = stories_cache(4096)
    runner = ModelRunner(None, cache)  # uploads only: no model runs
    tokens = list(range(3, 43))
    cache.add("a", tokens)
    step = cache.plan_step(["a"], [len(tokens)], token_ids=[tokens])
    slots = step.slot_mapping.clone()
    ids, pos = runner._upload(tokens, list(range(len(tokens))))
    assert ids.tolist() == tokens and pos.tolist() == list(range(len(tokens)))
    assert torch.equal(step.slot_mapping, slots)
    on_device = torch.tensor([7, 8], device=cache.device)
    ids, pos = runner._upload(on_device, [40, 41])  # device ids stay where they are; positions go up
    assert ids is on_device and pos.tolist() == [40, 41] and torch.equal(step.slot_mapping, slots)
    cache.free("a")
