"""benchmarks.experiments.step_ab's summary of same-process engine-step A/Bs (the measurement itself is GPU-only)."""

from __future__ import annotations

import pytest

from benchmarks.experiments.step_ab import summarize, variant


def _rec(kv, variant_, rnd, ctx, ms, B=32, context=2048):
    return {"kv": kv, "B": B, "context": context, "variant": variant_, "round": rnd, "ms": ms, "context_now": ctx}


def test_the_drift_of_engine_rounds_is_taken_out():
    # engine drifts 0.02 ms per 52 tokens of context; write_kernel is 0.05 ms slower, prefetch32 0.01 faster
    line = lambda ctx: 5.4 + 0.02 * (ctx - 2100) / 52  # noqa: E731
    recs = []
    ctx = 2100
    for rnd in range(3):
        for name, off in (("engine", 0.0), ("write_kernel", 0.05), ("prefetch32", -0.01)):
            recs.append(_rec("int4", name, rnd, ctx, line(ctx) + off))
            ctx += 52
    recs.append(_rec("bf16", "write_kernel", 0, 2100, 6.4))  # no engine record in its group: left out
    out = {s["variant"]: s for s in summarize(recs)}
    assert set(out) == {"write_kernel", "prefetch32"}
    assert out["write_kernel"]["mean_ms"] == pytest.approx(0.05)
    assert out["prefetch32"]["delta_ms"] == pytest.approx([-0.01] * 3)
    assert out["prefetch32"]["engine_ms_per_token"] == pytest.approx(0.02 / 52)
    # without correcting the drift, the later-measured variant would look slower than it is
    assert (recs[2]["ms"] - recs[0]["ms"]) > 0


def test_one_round_compares_with_the_engine_mean():
    out = summarize([_rec("bf16", "engine", 0, 2100, 6.0), _rec("bf16", "norm_fused", 0, 2152, 6.1)])
    assert out[0]["mean_ms"] == pytest.approx(0.1) and out[0]["engine_ms_per_token"] == 0.0


def test_unknown_variants_are_refused_before_any_engine():
    with pytest.raises(ValueError, match="unknown variant"):
        with variant("norm_off"):
            pass
