"""Tensor parallelism's pieces in one process: shards of the weights, and rank 0's cache calls replayed elsewhere.

The multi-process runs are in test_tensor_parallel.py; these check, without
starting anything, that (a) the ranks' slices tile every split tensor
(KV heads replicated beyond 4 ranks, intermediate channels split unevenly),
(b) a rank's random or loaded weights are the slices of the whole model's,
and (c) a second KVCache that replays what the scheduler did to the first
(preemptions, forks, aborts, prefix hits) plans identical steps.
"""

from __future__ import annotations

import pickle
import random

import pytest
import torch

pytest.importorskip("transformers")

from kvgen.engine import EngineError, SamplingParams  # noqa: E402
from kvgen.engine.config import ModelConfig  # noqa: E402
from kvgen.engine.parallel import RecordingCache, replay, step_fingerprint  # noqa: E402
from kvgen.engine.shard import TPShard, channel_range  # noqa: E402
from kvgen.engine.weights import build_model, load_weights, random_weights  # noqa: E402
from kvgen.integrations.tensor_parallel import head_shard  # noqa: E402

from .helpers import STORIES, TableRunner, all_free, fake_engine, stories_cache  # noqa: E402

SPLIT_NAMES = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_folder(STORIES)  # 8 query / 4 KV heads of 8, intermediate 172


def shards(cfg, tp):
    return [TPShard.of(cfg, r, tp, *head_shard(cfg.num_heads, cfg.num_kv_heads, r, tp)) for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_slices_tile_every_split_tensor(cfg, tp):
    for name in SPLIT_NAMES:
        parts = [s.split_of(f"model.layers.0.{name}", cfg) for s in shards(cfg, tp)]
        dim, full = parts[0][0], parts[0][3]
        assert all(p[0] == dim and p[3] == full for p in parts)
        covered = [i for _, start, stop, _ in parts for i in range(start, stop)]
        if tp == 8 and ("k_proj" in name or "v_proj" in name):  # 4 KV heads on 8 ranks: each held by two
            assert covered == [i for h in range(4) for _ in range(2) for i in range(h * 8, h * 8 + 8)]
        else:
            assert covered == list(range(full))
    assert shards(cfg, 1)[0].split_of("model.embed_tokens.weight", cfg) is None  # replicated
    assert [len(channel_range(172, r, 8)) for r in range(8)] == [21, 22, 21, 22, 21, 22, 21, 22]


def _sharded_model(cfg, shard):
    return build_model(cfg, 64, torch.device("cpu"), torch.float32, shard)


@pytest.mark.parametrize("fill", ["random", "checkpoint"])
def test_a_rank_holds_the_slices_of_the_whole_model(cfg, fill):
    def filled(model):
        return random_weights(model, seed=3) if fill == "random" else load_weights(model, STORIES)

    whole = dict(filled(_sharded_model(cfg, None)).named_parameters())
    for shard in shards(cfg, 8):  # uneven MLP split and replicated KV heads: the hardest case
        part = filled(_sharded_model(cfg, shard))
        for name, p in part.named_parameters():
            split = shard.split_of(name, cfg)
            want = whole[name] if split is None else whole[name].narrow(split[0], split[1], split[2] - split[1])
            assert torch.equal(p, want), (shard.rank, name)
        attn = part.model.layers[0].self_attn
        assert attn.qkv_weight.shape == (3 * 8, 64)  # 1 query + 1 KV head of 8 per rank, q/k/v fused
        assert attn.qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()


class ReplayingRunner(TableRunner):
    """Rank 0's stand-in runner that also plays a worker: replays the calls on a mirror cache and compares."""

    def __init__(self, mirror) -> None:
        super().__init__()
        self.mirror = mirror
        self.recorder: RecordingCache | None = None
        self.compared = 0
        self.calls: dict[tuple[str, bool], int] = {}

    def run(self, step, input_ids, positions, sample_rows):
        ops = self.recorder.take()
        for op, failed in ops:
            key = (pickle.loads(op)[0], failed is not None)
            self.calls[key] = self.calls.get(key, 0) + 1
        other = replay(self.mirror, ops)
        assert step_fingerprint(other) == step_fingerprint(step)
        for field in ("block_tables", "seq_lens", "num_compressed", "slot_mapping", "cu_seqlens_q"):
            assert torch.equal(getattr(other, field), getattr(step, field)), field
        self.compared += 1
        return super().run(step, input_ids, positions, sample_rows)


def test_a_mirror_cache_replaying_rank_0s_calls_plans_identical_steps():
    """Random requests (shared prefixes, n=2 forks, aborts) under a tiny page budget: every step agrees."""
    main, mirror = stories_cache(96, max_seqs=8), stories_cache(96, max_seqs=8)
    runner = ReplayingRunner(mirror)
    recorder = runner.recorder = RecordingCache(main)
    eng = fake_engine(recorder, runner, max_model_len=64, max_num_seqs=6, max_num_batched_tokens=24)
    rng = random.Random(5)
    prefix = [rng.randrange(64) for _ in range(20)]
    live: list[str] = []
    for i in range(40):
        if rng.random() < 0.7:
            prompt = (prefix[:rng.randrange(1, 20)] if rng.random() < 0.5 else []) + \
                [rng.randrange(64) for _ in range(rng.randrange(1, 12))]
            p = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True, n=rng.choice([1, 2]))
            live.append(eng.add_request(None, prompt, p))
        if live and rng.random() < 0.15:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    replay(mirror, recorder.take())  # the frees after the last step
    assert runner.compared > 30 and eng.scheduler.num_preemptions > 0
    assert {("add", False), ("free", False), ("fork", False), ("plan_step", False), ("plan_step", True)} <= \
        set(runner.calls)  # failed plans (out of pages) were replayed too
    assert all_free(main) and all_free(mirror)


def test_replay_refuses_a_call_whose_outcome_differs():
    cache = stories_cache(32)
    ok_free = (pickle.dumps(("free", (("nobody", 0),), {})), None)  # rank 0 says it succeeded; here it cannot
    with pytest.raises(EngineError, match="ranks diverged: free raised"):
        replay(cache, [ok_free])
    failed_add = (pickle.dumps(("add", (("a", 0), [1, 2]), {})), "OutOfPages")  # rank 0 failed; here it succeeds
    with pytest.raises(EngineError, match="raised OutOfPages on rank 0, not here"):
        replay(cache, [failed_add])


def test_recording_cache_records_calls_not_queries_and_marks_failures():
    cache = stories_cache(32)
    rec = RecordingCache(cache)
    assert rec.add(("a", 0), [1, 2, 3]) == 0 and rec.page_size == cache.page_size
    assert rec.sequences() == [("a", 0)] and rec.seq_len(("a", 0)) == 0
    assert [pickle.loads(op)[:2] for op, _ in rec.take()] == [("add", (("a", 0), [1, 2, 3]))]
    assert rec.take() == []
    with pytest.raises(Exception) as e:
        rec.free(("nobody", 0))
    [(op, failed)] = rec.take()
    assert pickle.loads(op)[0] == "free" and failed == type(e.value).__name__
