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


def run(engine, prompts, params):
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[i] for i in ids]


@pytest.mark.parametrize("kv", ["bf16", "int8", "int4"])
def test_graph_decode_equals_eager(kv):
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=2)
    results = []
    for eager in (True, False):
        eng = build_engine(config=TINY, kv=kv, dtype="bfloat16", device="cuda", max_model_len=1024,
                           max_num_seqs=24, max_tokens=8192, enforce_eager=eager, autotune=False, verbose=False)
        results.append(run(eng, prompts, params))
        if not eager:
            assert eng.runner.graph_steps > 20
        assert all_free(eng.cache)
    assert results[0] == results[1]


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
