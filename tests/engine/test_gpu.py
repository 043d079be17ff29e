"""Engine on the GPU (``KVGEN_TEST_DEVICE=cuda pytest -m gpu tests/engine``): CUDA-graph decode equals eager.

Autotuning is off in both engines so eager and graph steps launch the same
kernel configs: the tokens must then be identical, forks and preemption
included.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvgen.engine import SamplingParams
from kvgen.engine.loader import build_engine

from .helpers import STORIES, all_free

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = dict(model_type="llama", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_theta=500000.0, tie_word_embeddings=False)


def run(engine, prompts, params, completion=lambda c: c.token_ids):
    """Every prompt to the end; per prompt, ``completion(c)`` of each of its completions."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [completion(c) for c in out.outputs]
    return [done[i] for i in ids]


@pytest.mark.parametrize("kv,backend", [("bf16", "triton"), ("int8", "triton"), ("int4", "triton"),
                                        ("int8", "cuda"), ("int4", "cuda")])
def test_graph_decode_matches_eager(kv, backend):
    """Every replayed step's hidden states equal an eager run of the same step (same K/V rewritten: idempotent),
    with the Triton kernels and with the CUDA decode kernel (``kernel_backend="cuda"``).

    Not bitwise: a graph pads the batch to its bucket and its block tables to
    max_model_len, so the decode kernel may split the keys differently.
    """
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=2)
    eng = build_engine(config=TINY, kv=kv, dtype="bfloat16", device="cuda", max_model_len=1024,
                       max_num_seqs=24, max_tokens=8192, autotune=False, verbose=False, kernel_backend=backend)
    # (TINY's head_dim 64 is a CUDA decode shape; Triton modules have no BACKEND)
    assert getattr(eng.cache.kernels["decode"], "BACKEND", "triton") == backend
    graphs, model = eng.runner.graphs, eng.runner.model
    errors = []
    replay = graphs.run

    def checked(step, ids, pos):
        got = replay(step, ids, pos).clone()
        ref = model(ids, pos, eng.runner._attend(step))
        errors.append(float((got.float() - ref.float()).norm() / ref.float().norm()))
        return got

    graphs.run = checked
    outs = run(eng, prompts, params)
    assert all(len(c) == 48 for o in outs for c in o)
    assert eng.runner.graph_steps > 20 and len(errors) == eng.runner.graph_steps
    assert max(errors) < 2e-2, max(errors)
    if kv == "int4":
        assert graphs.converted_steps > 0
    assert all_free(eng.cache)


def test_stories_fp32_on_gpu_equals_hf():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).cuda().eval()
    tok = transformers.AutoTokenizer.from_pretrained(STORIES)
    eng = build_engine(STORIES, kv="fp32", dtype="float32", device="cuda", max_num_seqs=8, max_tokens=4096,
                       verbose=False)
    prompts = ["Once upon a time", "The little dog ran to the park and saw", "Lily"]
    outs = run(eng, prompts, SamplingParams(temperature=0, max_tokens=64, min_tokens=64, n=2))
    for p, got in zip(prompts, outs):
        ids = tok(p, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
        assert got == [ref[0, ids.shape[1]:].tolist()] * 2
    assert eng.runner.graph_steps > 0


def run_with_logprobs(engine, prompts, params):
    """:func:`run` with each completion's per-token logprobs: [[(token_ids, logprobs), ...], ...]."""
    return run(engine, prompts, params, completion=lambda c: (c.token_ids, c.logprobs))


NEAR_TIE = 0.1
"""Largest logprob gap (nats) between the reference's token and ours where a bf16 run may pick either: a
different batch composition makes cuBLAS pick other kernels (split-K or not), so logits differ in their
last bits; a corrupted KV cache moves them by far more."""


def assert_same_until_a_near_tie(got, want):
    """Greedy completions agree token for token, or first differ where the reference had a near tie."""
    for g_req, w_req in zip(got, want, strict=True):
        for (g, _), (w, w_lp) in zip(g_req, w_req, strict=True):
            if g == w:
                continue
            i = next(j for j in range(min(len(g), len(w))) if g[j] != w[j])
            top = w_lp[i]
            assert g[i] in top, f"token {i}: ours {g[i]} is not in the reference's top logprobs {top}"
            gap = top[w[i]] - top[g[i]]
            assert gap <= NEAR_TIE, f"token {i}: ours {g[i]} vs reference {w[i]}, logprob gap {gap:.3f} (not a tie)"


@pytest.mark.parametrize("kv", ["bf16", "int4"])
def test_swap_preemption_with_graphs_equals_an_unpressured_run(kv):
    """A host tier (pinned memory, side-stream copies) under a tiny device budget: graphs on, same tokens.

    Same tokens up to bf16 noise: the pressured run decodes other batch
    compositions, whose GEMMs round differently, so a completion may leave
    the reference's path only where the reference had a near tie.
    """
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=48, n=2, logprobs=3)
    rng = random.Random(3)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(8, 60))] for _ in range(8)]
    big = build_engine(config=TINY, kv=kv, device="cuda", max_num_seqs=16, max_tokens=16384, autotune=False,
                       verbose=False)
    assert big.cache.warmup_report.skipped is None, big.cache.warmup_report.skipped
    want = run_with_logprobs(big, prompts, params)
    small = build_engine(config=TINY, kv=kv, device="cuda", max_num_seqs=16, max_tokens=512, max_model_len=128,
                         host_tokens=8192, autotune=False, verbose=False)
    got = run_with_logprobs(small, prompts, params)
    sched = small.scheduler
    assert_same_until_a_near_tie(got, want)
    assert sched.num_swapped_out > 0 and sched.num_swapped_in > 0 and small.runner.graph_steps > 0
    assert small.runner.eager_steps > 0 and all_free(small.cache)


def _gemv_everywhere(model, rows, verbose=False, saved=None):
    """gemv.choose's stand-in: the GEMV for every projection and bucket it takes, untimed (and nothing ``saved``).
    Config 3 (4 vectors a lane in flight): TINY's down projection (k = 1024) then runs a whole chunk, the others
    (k = 512) only a bounds-checked one, so both chunk paths run under PDL."""
    from kvgen.engine import gemv

    for _, pairs in gemv.weight_groups(model):
        w0, b0 = pairs[0]
        for m in sorted({1 << (int(r) - 1).bit_length() for r in rows if 1 <= int(r) <= gemv.MAX_ROWS}):
            x = torch.empty(m, w0.shape[1], device=w0.device, dtype=w0.dtype)
            if all(gemv.supports(x, w, b) for w, b in pairs):
                gemv._CHOICES[gemv._key(x, w0, b0)] = 3
    return []


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0+")
@pytest.mark.parametrize("kv,backend", [("bf16", "cuda"), ("int4", "cuda"), ("int4", "triton")])
def test_pdl_launches_give_the_tokens_of_plain_launches(kv, backend, monkeypatch):
    """The decode graphs' PDL kernels (kvgen/engine/pdl.py: fused norm/RoPE/SiLU, the GEMV, the runtime's cache
    write, page quantize and decode with its split reduce) overlap their predecessors; their waits must make that
    invisible: two engines of the same random weights, one with ``KVGEN_PDL=0``, give the same tokens bit for bit
    (same kernels and configs), with the GEMV running every small-batch projection. (Two engines, not one run
    twice: a second run would hit the first's cached prefixes and compute other steps.)"""
    from kvgen.engine import gemv, pdl

    monkeypatch.setattr(gemv, "choose", _gemv_everywhere)
    launches = {True: 0, False: 0}
    real_enabled = pdl.enabled

    def counted(t):
        on = real_enabled(t)
        launches[on] += 1
        return on

    monkeypatch.setattr(pdl, "enabled", counted)
    rng = random.Random(5)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 200))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    outs, graph_steps = {}, {}
    try:
        for mode in ("1", "0"):
            monkeypatch.setenv("KVGEN_PDL", mode)
            eng = build_engine(config=TINY, kv=kv, dtype="bfloat16", device="cuda", max_model_len=512,
                               max_num_seqs=4, max_tokens=4096, autotune=False, verbose=False, kernel_backend=backend)
            assert getattr(eng.cache.kernels["decode"], "BACKEND", "triton") == backend
            if mode == "1":
                launches.update({True: 0, False: 0})
            outs[mode] = run_with_logprobs(eng, prompts, params)  # tokens and their top logprobs, bit for bit
            graph_steps[mode] = eng.runner.graph_steps
            if mode == "1":
                assert launches[True] > 0 and launches[False] == 0  # every kernel asked launched with PDL
            assert all_free(eng.cache)
            del eng
    finally:
        gemv.clear()
    assert graph_steps["1"] > 20 and graph_steps["1"] == graph_steps["0"]
    assert outs["1"] == outs["0"]
