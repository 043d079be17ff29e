"""benchmarks.decode_timing: the graph timer's reading is the fastest of its rounds, and every round is kept."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from benchmarks import decode_timing  # noqa: E402


def _readings(monkeypatch, values):
    it = itertools.cycle(values)
    calls = []

    def fake_graph_time_ms(fn):
        calls.append(fn)
        return next(it)
    monkeypatch.setattr(decode_timing, "graph_time_ms", fake_graph_time_ms)
    return calls


def test_sdpa_graph_reading_is_the_fastest_round(monkeypatch):
    """A slow round (a stretch the GPU ran slow) does not become the reading; all rounds are recorded."""
    calls = _readings(monkeypatch, [0.118, 0.102, 0.104])
    monkeypatch.setattr(decode_timing, "cold_copies", lambda nbytes, device: 1)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 16, 8)
    t = decode_timing.sdpa_times(q, k, k.clone(), timers=("graph",))
    assert t["graph_rounds"] == [0.118, 0.102, 0.104] and t["graph"] == 0.102
    assert len(calls) == decode_timing.GRAPH_ROUNDS


def test_decode_timer_rounds_and_quick_ranking(monkeypatch):
    """``both`` keeps every round and reports the fastest; a quick ranking (``ms(quick=True)``) times one round."""
    calls = _readings(monkeypatch, [0.2, 0.15, 0.3])
    pools = {"k": torch.zeros(8, 2, 16, 8), "v": torch.zeros(8, 2, 16, 8)}
    dt = decode_timing.DecodeTimer(pools, torch.arange(4, dtype=torch.int32).view(1, 4), compressed=4)
    monkeypatch.setattr(dt, "_do_bench", lambda launch, cfg, rep_ms=200: 0.25)
    both = dt.both(lambda cfg, p, t: None, {})
    assert both == {"graph": 0.15, "graph_rounds": [0.2, 0.15, 0.3], "do_bench": 0.25}
    calls.clear()
    dt.ms(lambda cfg, p, t: None, {}, quick=True)
    assert len(calls) == 1


def test_benchmark_ranking_confirms_its_front_runners():
    """benchmarks.run.best_config ranks as the runtime's tuner does: the best config, read 15% slow the first time
    behind a runner-up, is ranked again and wins with its faster reading; a far-off config is read once."""
    import types

    from benchmarks.run import best_config

    true_ms = {1: 0.10, 2: 0.11, 3: 0.50}
    reads = []

    def rank(cfg):
        first = cfg["id"] not in reads
        reads.append(cfg["id"])
        return true_ms[cfg["id"]] * (1.15 if first and cfg["id"] == 1 else 1.0)

    mod = types.SimpleNamespace(candidates=lambda b, l: [{"id": i} for i in (1, 2, 3)])
    ms, cfg, times = best_config(mod, None, 1, 16, rank)
    assert cfg == {"id": 1} and ms == 0.10 and reads.count(3) == 1 and reads.count(1) == reads.count(2) == 2
    assert sorted(m for m, _ in times) == [0.10, 0.11, 0.50]
