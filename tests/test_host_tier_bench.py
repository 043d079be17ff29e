"""benchmarks/host_tier.py --smoke on the CPU (interpreted kernels): every record the H200 run writes, tiny.

One run of both parts (tier, engine) checks the records' shape and the
relations that hold whatever the timings: the planner's prediction is the
planner's own function of the record's bytes, the engine's two preemption
modes generate the same number of tokens from the same requests under a
budget of half their KV, and the swap run really swapped.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import host_tier


@pytest.mark.slow
def test_host_tier_smoke_writes_every_record_and_the_summary(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert host_tier.main(["--smoke", "--schemes", "fp32", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    recs = doc["records"]
    ops = [r["op"] for r in recs]
    for op in ("pinned_h2d", "pinned_d2h", "swap_out", "swap_in", "decode_during_swap_out",
               "engine_swap", "engine_recompute"):
        assert op in ops
    dec = [r for r in recs if r["op"] == "decode_host"]
    assert [r["host_fraction"] for r in dec] == [0.0, 0.25, 0.5, 0.75]
    from kvgen.planner.host_cost import host_step_cost

    for r in dec:
        assert r["predicted_ms"] > 0
        assert r["prediction_error"] == pytest.approx(r["ms"] / r["predicted_ms"] - 1)
        # the transfer term is the planner's, at the pinned bandwidth measured in the run
        assert host_step_cost(0, r["bytes"], doc["memory_bandwidth"], doc["pinned_h2d"], 2).transfer_ms == \
            pytest.approx(r["transfer_ms"])
    assert dec[0]["bytes"] == 0 and dec[-1]["bytes"] > dec[1]["bytes"] > 0
    swap, recompute = (next(r for r in recs if r["op"] == f"engine_{m}") for m in ("swap", "recompute"))
    assert swap["generated"] == recompute["generated"] > 0
    assert swap["kv_ratio"] == pytest.approx(2.0, abs=0.2)
    assert swap["num_preemptions"] > 0 and swap["swapped_out"] > 0 and swap["swapped_in"] == swap["swapped_out"]
    assert recompute["num_preemptions"] > 0 and recompute["swapped_out"] == 0
    assert swap["tokens_per_s"] == pytest.approx(swap["generated"] / swap["wall_s"])
    tail = capsys.readouterr().out
    assert "engine_swap" in tail and "engine_recompute" in tail and "pred_err" in tail


def test_host_tier_rejects_unknown_parts():
    with pytest.raises(SystemExit):
        host_tier.main(["--smoke", "--parts", "tier,bogus"])
