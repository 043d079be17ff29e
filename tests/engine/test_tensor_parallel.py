"""The engine at tp=2 and tp=4 (gloo worker processes, Triton interpreter) generates what tp=1 does.

stories260K has 8 query / 4 KV heads: tp=2 gives each rank 4 / 2, tp=4
gives 2 / 1. The tp=2 run uses a page budget small enough to preempt and a
request with n=2 (a fork), so every kind of cache call the scheduler makes
is replayed on the worker. Sizes are tiny: an interpreted step costs about
0.25 s per sequence on every rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvgen.engine import EngineError, SamplingParams  # noqa: E402
from kvgen.engine.llm import LLM  # noqa: E402
from kvgen.errors import KvgenError  # noqa: E402

PROMPTS = ["The little dog ran to the park and saw a big red ball. He", "Once upon a time", "Lily"]
TOKENS = 6
# 48 tokens of pages (3 pages of 16) for 4 completions of up to 20 tokens: the scheduler must preempt.
SMALL = dict(kv="fp32", max_tokens=48, max_model_len=48, max_num_seqs=4, verbose=False)


def params(n_tokens: int = TOKENS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens, n=2 if i == 1 else 1)
            for i in range(len(PROMPTS))]


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def stories(shared_data):
    return str(shared_data / "models" / "stories260K")


@pytest.fixture(scope="module")
def tp1(stories):
    from kvgen.engine.parallel import RecordingCache
    from kvgen.engine.runner import ModelRunner

    with LLM(stories, **SMALL) as llm:
        eng = llm.engine
        assert type(eng.runner) is ModelRunner and not isinstance(eng.cache, RecordingCache)  # no processes
        outs = token_ids(llm.generate(PROMPTS, params()))
        assert eng.scheduler.num_preemptions > 0
    return outs


def test_tp2_generates_tp1_tokens_with_preemption_and_forks(stories, tp1):
    with LLM(stories, tp=2, **SMALL) as llm:
        eng = llm.engine
        assert eng.cache.num_kv_heads == 2 and list(eng.cache.kv_head_range()) == [0, 1]
        outs = token_ids(llm.generate(PROMPTS, params()))
        assert outs == tp1  # token for token, both completions of the forked request included
        assert len(outs[1]) == 2 and eng.scheduler.num_preemptions > 0
        info = eng.runner.rank_info()
    assert [i["kv_heads"] for i in info] == [[0, 1], [2, 3]]
    assert [i["q_heads"] for i in info] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for i in info:  # every rank ran every step, and every page came back on every rank
        assert i["steps"] == info[0]["steps"] > 0
        assert i["sequences"] == 0 and i["free_pages"] == i["pages"]
    assert not eng.runner.workers.dead() or all(code == 0 for _, code in eng.runner.workers.dead())


def test_tp4_one_kv_head_per_rank(stories, tp1):
    with LLM(stories, tp=4, kv="fp32", max_tokens=256, max_num_seqs=2, verbose=False) as llm:
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, min_tokens=3))
        info = llm.engine.runner.rank_info()
        workers = llm.engine.runner.workers
    assert [o.outputs[0].token_ids for o in outs] == [tp1[0][0][:3], tp1[1][0][:3]]
    assert [i["kv_heads"] for i in info] == [[0], [1], [2], [3]]
    assert [p.returncode for p in workers.procs] == [0, 0, 0]  # close() stopped them


def test_kvgen_generate_tp2_prints_tp1_tokens(stories, tp1, capsys):
    import argparse
    import json

    from kvgen.engine import cli

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(["--model", stories, "--prompt", PROMPTS[2], "--kv", "fp32", "--max-tokens", "3",
                              "--ignore-eos", "--tp", "2", "--max-model-len", "48", "--json"])
    assert cli.run(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == tp1[2][0][:3]


@pytest.mark.parametrize("tp", [3, 6])
def test_tp_that_does_not_divide_the_heads_is_refused_before_any_process(stories, tp, monkeypatch):
    from kvgen.engine import parallel

    monkeypatch.setattr(parallel, "Workers", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(KvgenError, match=f"--tp {tp} does not divide"):
        LLM(stories, tp=tp, **SMALL)


@pytest.mark.parametrize("tp", [0, -2, 1.5, "2", True])
def test_tp_must_be_a_positive_int(stories, tp):
    with pytest.raises(EngineError, match="tp must be an int >= 1"):
        LLM(stories, tp=tp, **SMALL)


def test_tp_on_a_gpu_index_other_than_0_is_refused(stories):
    from kvgen.engine.loader import check_tp

    with pytest.raises(EngineError, match="rank r runs on cuda:r"):
        check_tp(2, torch.device("cuda", 1))
    with pytest.raises(EngineError, match="CUDA GPUs .NCCL. or the CPU"):
        check_tp(2, torch.device("meta"))
    assert check_tp(1, torch.device("cuda", 3)) == torch.device("cuda", 3)  # tp=1: whatever device was asked


@pytest.mark.gpu
@pytest.mark.parametrize("tp,eager", [(2, False), (2, True), (4, False), (8, False)])
def test_nccl_tp_matches_tp1_on_gpus(stories, tp, eager):
    """NCCL ranks on cuda:0..tp-1 (CUDA graphs with the all-reduces inside, unless eager) give tp=1's tokens."""
    import os

    if torch.cuda.device_count() < tp or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(f"needs {tp} CUDA GPUs and compiled (not interpreted) kernels")
    prompts = [p * 3 for p in PROMPTS]
    budget = dict(kv="fp32", device="cuda", max_tokens=128, max_model_len=128, max_num_seqs=4, autotune=False,
                  verbose=False)
    with LLM(stories, **budget) as llm:
        ref = token_ids(llm.generate(prompts, params(32)))
    with LLM(stories, tp=tp, enforce_eager=eager, **budget) as llm:
        eng = llm.engine
        assert token_ids(llm.generate(prompts, params(32))) == ref
        assert eng.scheduler.num_preemptions > 0 and (eager or eng.runner.graph_steps > 0)
        info = eng.runner.rank_info()
    assert all(i["steps"] == info[0]["steps"] and i["free_pages"] == i["pages"] for i in info)
    assert len({tuple(i["kv_heads"]) for i in info}) == min(tp, 4)  # tp=8: each KV head on two ranks


def test_a_failure_while_loading_stops_every_worker(stories, tmp_path, monkeypatch):
    """Rank 0 fails to load its shard (weights not matching config.json): the error propagates, no worker is left."""
    import json
    import shutil

    from kvgen.engine import parallel

    bad = tmp_path / "bad"
    shutil.copytree(stories, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 176}))
    started = []

    class Recorded(parallel.Workers):
        def __init__(self, world):
            super().__init__(world)
            started.append(self)

    monkeypatch.setattr(parallel, "Workers", Recorded)
    with pytest.raises(EngineError, match="the config and weights do not match"):
        LLM(str(bad), tp=2, **SMALL)
    [workers] = started
    assert len(workers.procs) == 1 and all(p.poll() is not None for p in workers.procs)
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_tp2_with_a_host_tier_swaps_on_every_rank_and_generates_tp1_tokens(stories, tp1):
    """Preemption by swap at tp=2: the worker replays rank 0's swap_out/swap_in on its own host tier."""
    with LLM(stories, tp=2, host_tokens=256, **SMALL) as llm:
        eng = llm.engine
        outs = token_ids(llm.generate(PROMPTS, params()))
        assert outs == tp1
        sched = eng.scheduler
        assert sched.preemption_mode == "swap" and sched.num_swapped_out > 0 and sched.num_swapped_in > 0
        info = eng.runner.rank_info()
        assert all(r["sequences"] == 0 and r["free_pages"] == r["pages"] for r in info)
        assert all(r["pages"].get("host_compressed", 0) > 0 for r in info)  # every rank's host tier counted
