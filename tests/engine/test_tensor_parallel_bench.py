"""benchmarks/tp_engine.py on the CPU: its arithmetic against real sharded models, its table, its command line.

The measurements need several GPUs; here the helpers are checked against
the engine itself (a rank's weight bytes as built by ``build_model`` with
its shard), and a CPU smoke run of the whole script is ``slow``.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import tp_engine as bench  # noqa: E402
from kvgen.engine.config import ModelConfig  # noqa: E402
from kvgen.engine.shard import TPShard  # noqa: E402
from kvgen.engine.weights import build_model  # noqa: E402
from kvgen.integrations.tensor_parallel import head_shard  # noqa: E402


def _rank_bytes(config: dict, tp: int, rank: int) -> int:
    cfg = ModelConfig.from_dict(config)
    shard = None if tp == 1 else TPShard.of(cfg, rank, tp, *head_shard(cfg.num_heads, cfg.num_kv_heads, rank, tp))
    model = build_model(cfg, 16, torch.device("meta"), torch.float32, shard)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_per_rank_is_what_the_engine_allocates(tied):
    config = dict(bench.model_config(tiny=True), tie_word_embeddings=tied)
    assert bench.param_count(config) * 4 == _rank_bytes(config, 1, 0)
    for tp in (1, 2, 4, 8):  # 8: KV heads replicated, 172 channels split 21/22
        largest = max(_rank_bytes(config, tp, r) for r in range(tp))
        assert bench.weight_bytes_per_rank(config, tp, 4) == largest


def test_llama3_70b_shape_and_what_fits_an_h200():
    config = bench.model_config()
    ModelConfig.from_dict(config)  # a config the engine accepts
    assert 70.5e9 < bench.param_count(config) < 70.6e9  # Llama-3-70B: 70.6B parameters
    h200 = 141 * 10**9
    fits = [tp for tp in (1, 2, 4, 8) if bench.weight_bytes_per_rank(config, tp, 2) <= bench.WEIGHT_HEADROOM * h200]
    assert fits == [2, 4, 8]  # tp=1 is recorded as skipped at 80 layers
    assert bench.weight_bytes_per_rank(bench.model_config(layers=8), 1, 2) < bench.WEIGHT_HEADROOM * h200


def test_tps_roofline_and_workload():
    assert bench.tps_to_run([1, 2, 4, 8], 4) == [1, 2, 4]
    assert bench.tps_to_run([8, 2], 8) == [8, 2]
    assert bench.roofline_ms(3e9, 1e9, 4e12) == pytest.approx(1.0)
    reqs = bench.workload(20, prompt=(5, 9), output=(2, 3), vocab=512)
    assert reqs == bench.workload(20, prompt=(5, 9), output=(2, 3), vocab=512)  # seeded
    assert all(5 <= len(p) <= 9 and 2 <= n <= 3 and all(0 <= t < 512 for t in p) for p, n in reqs)


def test_table_scales_against_the_smallest_tp():
    recs = [dict(kind="step", tp=1, kv="bf16", B=32, context=2048, skipped="weights too big"),
            dict(kind="step", tp=2, kv="bf16", B=32, context=2048, ms=40.0, roofline_ms=30.0),
            dict(kind="step", tp=4, kv="bf16", B=32, context=2048, ms=20.0, roofline_ms=15.0),
            dict(kind="throughput", tp=2, kv="int4", requests=8, tokens_per_s=100.0),
            dict(kind="throughput", tp=4, kv="int4", requests=8, tokens_per_s=300.0),
            dict(kind="step", tp=8, kv="bf16", B=32, context=2048, error="RuntimeError: boom")]
    lines = bench.table(recs).splitlines()
    assert "weights too big" in lines[1] and "boom" in lines[6]
    assert lines[2].endswith("1.00x") and lines[3].endswith("2.00x") and lines[5].endswith("3.00x")
    assert " 1600 " in lines[3]  # 32 sequences per 20 ms


def test_compare_counts_the_common_prefix_and_its_logits_error():
    ref = ([5, 6, 7, 8], [torch.ones(1, 4) * i for i in range(1, 5)])
    same = bench.compare(ref, ref)
    assert same == dict(tokens_equal=True, matching_tokens=4, tokens=4, logits_rel_l2=0.0)
    off = ([5, 6, 9, 9], [ref[1][0], ref[1][1], ref[1][2] * 1.1, ref[1][3] * 5])
    got = bench.compare(ref, off)  # steps 0..2 count (step 2 drew the first differing token), step 3 does not
    assert got["matching_tokens"] == 2 and not got["tokens_equal"]
    assert got["logits_rel_l2"] == pytest.approx(0.3 / (1 + 4 + 9) ** 0.5)
    line = bench.table([dict(kind="equivalence", tp=2, kv="bfloat16", dtype="bfloat16", **got)]).splitlines()[1]
    assert "2/4 tokens as tp=1" in line


def test_help_parses(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--tps" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_smoke_run_writes_a_record_per_tp(tmp_path):
    out = tmp_path / "tp.json"
    code = bench.main(["--tiny", "--device", "cpu", "--tps", "1,2", "--kv", "fp32", "--shapes", "2x8", "--steps", "1",
                       "--requests", "2", "--equivalence-tokens", "4", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0 and doc["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert doc["kernel_backend"] == "auto"  # the backend the engines were asked for (the default), recorded
    assert [(r["kind"], r["tp"]) for r in doc["records"]] == [("equivalence", 2), ("step", 1), ("throughput", 1),
                                                              ("step", 2), ("throughput", 2)]
    assert doc["records"][0]["tokens_equal"] and doc["records"][0]["logits_rel_l2"] < 1e-5
    assert all(r["ms"] > 0 for r in doc["records"][1:])
