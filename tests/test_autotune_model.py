"""Issue 13 item 12: the first step of a new shape never waits for tuning.

The decode config comes from a model of the kernel fitted to the H200
measurements in benchmarks/results/; tuning (ahead of time, or on first use
with KVGEN_AUTOTUNE=sync) times at most MAX_CANDIDATES configs within a
budget. All of it runs on the CPU: SM counts are parameters here.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from kvgen.runtime.autotune import Autotuner, tune
from kvgen.runtime.autotune_model import MAX_CANDIDATES, decode_model, model_config, ranked_candidates, valid_config
from kvgen.runtime.errors import KvgenRuntimeError
from .test_autotune import first_reading

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks/results/2026-11-29-nvidia-h200/bench-decode/results.json"
H200_SMS = 132


def measured_winners():
    """(B, L, Hkv, D) -> the autotuner's winning configs over every scheme on the H200."""
    out = defaultdict(list)
    for r in json.loads(H200.read_text())["records"]:
        if r["op"] == "decode" and r.get("config"):
            out[(r["B"], r["L"], r["Hkv"], r["D"])].append(r["config"])
    return out


def test_decode_model_agrees_with_the_h200_measurements():
    winners = measured_winners()
    assert len(winners) >= 5
    for (B, L, H, D), cfgs in winners.items():
        got = decode_model(B, H, L, 16, D, H200_SMS)
        splits = [c["num_splits"] for c in cfgs]
        # splits within a factor of two of the range the winners span (they differ by scheme)
        assert min(splits) / 2 <= got["num_splits"] <= max(splits) * 2, ((B, L, H, D), got, splits)
        tiles = [c["pages_per_tile"] for c in cfgs]
        if D == 128:  # the most frequent winning tile: 8 pages of 16 tokens, 4 warps
            assert got["pages_per_tile"] == max(set(tiles), key=tiles.count)
            assert got["num_warps"] == 4


def test_decode_model_shape_rules():
    # enough programs already: no split (no reduce kernel)
    assert decode_model(64, 8, 2048, 16, 128, 132)["num_splits"] == 1
    # few programs: about four per SM, capped by the tiles there are and MAX_SPLITS
    assert decode_model(1, 8, 131072, 16, 128, 132)["num_splits"] == 66
    assert decode_model(1, 8, 256, 16, 128, 132)["num_splits"] == 2  # 16 pages = 2 tiles of 8
    # a split streams at least 4 tiles: 16K tokens = 128 tiles of 128 -> 32 splits, not 66
    assert decode_model(1, 8, 16384, 16, 128, 132)["num_splits"] == 32
    # ... unless that leaves SMs without a program: 4K = 32 tiles -> 17 splits (8 x 17 >= 132), not 8
    assert decode_model(1, 8, 4096, 16, 128, 132)["num_splits"] == 17
    assert decode_model(1, 8, 2048, 16, 128, 132)["num_splits"] == 16  # every tile its own split, as before
    assert decode_model(1, 1, 1 << 20, 16, 128, 132, max_splits=128)["num_splits"] == 128
    # more SMs, more splits; wide heads take 32-token tiles as the template does
    assert decode_model(8, 8, 32768, 16, 128, 78)["num_splits"] < decode_model(8, 8, 32768, 16, 128, 132)["num_splits"]
    assert decode_model(8, 8, 32768, 16, 256, 132)["pages_per_tile"] == 2


@pytest.fixture(scope="module")
def decode_module():
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    spec = KernelSpec(op="decode", scheme="int8", head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch="sm_90")
    return load_kernel(spec, default_registry().schemes["int8"])


@pytest.mark.parametrize("sizes", [(32, 4096), (1, 131072), (8, 32768), (64, 2048), (2, 64)])
def test_model_config_is_a_valid_candidate(decode_module, sizes):
    cfg = model_config("decode", decode_module, sizes, H200_SMS)
    assert valid_config(cfg, decode_module, sizes)
    compiled = {k: v for k, v in cfg.items() if k != "num_splits"}
    assert any(all(c[k] == v for k, v in compiled.items()) for c in decode_module.candidates(*sizes))
    ideal = decode_model(sizes[0], 8, sizes[1], 16, 128, H200_SMS)
    assert cfg == ideal  # the template offers the model's tile, warps and stages


@pytest.mark.parametrize("sizes", [(32, 4096), (1, 131072), (8, 32768)])
def test_pruned_candidates_are_few_and_cheap_to_compile(decode_module, sizes):
    every = decode_module.candidates(*sizes)
    ranked = ranked_candidates("decode", decode_module, sizes, H200_SMS)
    assert len(every) > MAX_CANDIDATES >= len(ranked) >= 4
    assert ranked[0] == model_config("decode", decode_module, sizes, H200_SMS)
    assert all(valid_config(c, decode_module, sizes) for c in ranked)
    assert len({tuple(c.items()) for c in ranked}) == len(ranked)
    # the split count is a runtime argument: most neighbours reuse one compiled variant
    variants = {(c["pages_per_tile"], c["num_warps"], c["num_stages"], c["num_splits"] == 1) for c in ranked}
    assert len(variants) <= 4


class Timer:
    def __init__(self, sleep=0.0):
        self.calls, self.sleep = 0, sleep

    def __call__(self, fn):
        import time
        self.calls += first_reading(self, fn)
        time.sleep(self.sleep)
        return fn()


def fake_module():
    import types
    m = types.ModuleType("fake_model_decode")
    m.default_config = lambda *shape, device=None: {"tile": 16, "warps": 4}
    m.candidates = lambda *shape: [{"tile": t, "warps": w} for t in (16, 32, 64, 128) for w in (2, 4, 8)]
    return m


def bench(cfg):
    return lambda: abs(cfg["tile"] - 32) + cfg["warps"]


class FakeClock:
    """Wall seconds that move only when a fake kernel runs or a fake bench input is made."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def clocked_bench(clock, first_s, run_s, inputs_s=0.0, log=None):
    """make_bench whose first call per compiled variant costs ``first_s`` (compile), later ones ``run_s``.

    The first make_bench call costs ``inputs_s`` (the bucket's synthetic inputs).
    """
    built: set = set()
    state = {"inputs": False}

    def make(cfg):
        if not state["inputs"]:
            state["inputs"] = True
            clock.now += inputs_s

        def fn():
            variant = tuple(sorted((k, v) for k, v in cfg.items() if k != "num_splits"))
            clock.now += run_s if variant in built else first_s
            built.add(variant)
            if log is not None:
                log.append(dict(cfg))
            return abs(cfg["tile"] - 32) + cfg["warps"]
        return fn
    return make


class CountingTimer:
    """do_bench stand-in: runs fn a few times (each run advances the fake clock)."""

    def __init__(self, runs=3):
        self.calls, self.runs = 0, runs

    def __call__(self, fn):
        self.calls += first_reading(self, fn)
        return min(fn() for _ in range(self.runs))


def test_tuning_is_pruned_and_budgeted(tmp_path):
    timer = Timer()
    t = Autotuner("cpu", force=True, timer=timer, directory=tmp_path, stream=io.StringIO())
    t.config("decode", fake_module(), (4, 256), bench, kernel_hash="ab" * 8)
    assert timer.calls == MAX_CANDIDATES < len(fake_module().candidates())


def test_budget_never_starts_a_candidate_that_would_end_past_it(tmp_path):
    """Inputs 0.5 s, then each candidate 1.0 s (a compile) + 3 x 0.1 s (timing). A new variant is predicted
    at twice the slowest compile so far plus timing (2.3 s): the second starts at 1.8 s (ends 3.1 s), a third
    would likely end at 5.4 s and never starts. (Starting while under budget ran candidates to 5.7 s.)"""
    clock, timer, log = FakeClock(), CountingTimer(), []
    t = Autotuner("cpu", force=True, timer=timer, directory=tmp_path, stream=io.StringIO(), clock=clock,
                  budget_s=5.0)
    entry = t.tune("decode", fake_module(), (4, 4096), clocked_bench(clock, 1.0, 0.1, inputs_s=0.5, log=log),
                   kernel_hash="cd" * 8)
    assert entry["candidates"] == timer.calls == 2
    confirmations = timer.readings - timer.calls  # front-runners timed again (CONFIRM_WITHIN), within the budget
    assert confirmations >= 1
    # inputs are in the budget
    assert entry["seconds"] == pytest.approx(0.5 + 2 * (1.0 + 3 * 0.1) + confirmations * 3 * 0.1)
    assert entry["seconds"] <= 5.0
    # every candidate is compiled by one call before it is timed: the timer never sees the compile
    assert len(log) == 2 + timer.readings * timer.runs


def test_budget_lets_cheap_split_neighbours_run_after_a_compile(tmp_path):
    """Candidates differing only in num_splits reuse a compiled variant: predicted at their own (run) cost."""
    clock, timer = FakeClock(), CountingTimer()
    mod = fake_module()
    mod.candidates = lambda *shape: [{"num_splits": s, "tile": t, "warps": 4} for t in (32, 64) for s in (1, 2, 4, 8)]
    mod.default_config = lambda *shape, device=None: {"num_splits": 1, "tile": 32, "warps": 4}
    t = Autotuner("cpu", force=True, timer=timer, directory=tmp_path, stream=io.StringIO(), clock=clock,
                  budget_s=5.0)
    entry = t.tune("decode", mod, (4, 4096), clocked_bench(clock, 3.0, 0.1), kernel_hash="ef" * 8)
    # tile 32: 3.4 s then 0.4 s per split neighbour; tile 64 (a new compile, predicted 6.3 s) never starts
    assert entry["candidates"] == 4 and entry["seconds"] <= 5.0
    assert all(c["tile"] == 32 for c in [entry["config"]])
    # a budget that fits one compile more (4.6 s so far + 2 x 3.0 s + 0.3 s predicted) lets the new variant run
    clock2, timer2 = FakeClock(), CountingTimer()
    t2 = Autotuner("cpu", force=True, timer=timer2, directory=tmp_path / "b", stream=io.StringIO(), clock=clock2,
                   budget_s=11.0)
    assert t2.tune("decode", mod, (4, 4096), clocked_bench(clock2, 3.0, 0.1), kernel_hash="ef" * 8)["candidates"] > 4


def test_modes_decide_whether_the_request_path_times(tmp_path, monkeypatch):
    monkeypatch.setattr(Autotuner, "can_time", lambda self: True)  # as on a GPU
    mod = fake_module()
    cached = Timer()
    t = Autotuner("meta", timer=cached, directory=tmp_path, progress=False)
    assert t.mode == "cached" and not t.should_tune()
    assert t.config("decode", mod, (4, 256), bench, kernel_hash="cd" * 8) == {"tile": 16, "warps": 4}
    assert cached.calls == 0 and t.origin("decode", mod, (4, 256), "cd" * 8) == "model"
    sync = Timer()
    t = Autotuner("meta", timer=sync, directory=tmp_path, progress=False, mode="sync")
    assert t.config("decode", mod, (4, 256), bench, kernel_hash="cd" * 8) == {"tile": 32, "warps": 2}
    assert sync.calls > 0
    # a fresh process in the default mode now finds the winner; "off" ignores it
    assert Autotuner("meta", directory=tmp_path).config("decode", mod, (4, 256), None, "cd" * 8) == {"tile": 32, "warps": 2}
    assert Autotuner("meta", directory=tmp_path, mode="off").config("decode", mod, (4, 256), None, "cd" * 8) == \
        {"tile": 16, "warps": 4}
    assert not Autotuner("meta", directory=tmp_path, mode="sync", enabled=False).should_tune()


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("KVGEN_AUTOTUNE", "sync")
    assert Autotuner("cpu").mode == "sync"
    monkeypatch.setenv("KVGEN_AUTOTUNE", "sometimes")
    with pytest.raises(KvgenRuntimeError, match="KVGEN_AUTOTUNE must be one of cached, sync, off"):
        Autotuner("cpu")
    monkeypatch.delenv("KVGEN_AUTOTUNE")
    assert Autotuner("cpu").mode == "cached"


def _cache(tmp_path, tuner):
    import types

    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.runtime import load
    from kvgen.targets import resolve_target

    plan = make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(context=4096),
                     default_registry().schemes, kv="int8").to_json()
    plan["kernels"] = {"decode": {"hash": "deadbeefdeadbeef"}, "prefill": {"hash": "0123456789abcdef"}}
    kernels = {}
    for op in ("decode", "prefill", "cache_write", "page_copy", "page_quantize", "dequant"):
        m = fake_module()
        m.__name__ = f"fake_model_{op}"
        m.launch = lambda *args, **kwargs: bench(kwargs["config"])() if kwargs.get("config") else 0.0
        kernels[op] = m
    return load(plan, kernels, device="meta", max_tokens=4096, num_layers=1, autotuner=tuner)


def test_tune_ahead_of_time_then_serve_without_timing(tmp_path):
    timer = Timer()
    cache = _cache(tmp_path, Autotuner("meta", force=True, timer=timer, directory=tmp_path, progress=False))
    records = tune(cache, [(1, 1024)], prefill_tokens=512)
    assert [r["key"] for r in records] == ["decode/b1/s1024", "prefill/b1/q512/s1024"]
    assert all(r["config"] == {"tile": 32, "warps": 2} and r["candidates"] == MAX_CANDIDATES for r in records)
    assert timer.calls == 2 * MAX_CANDIDATES
    # again: the decode winner is reused, only the new prefill bucket (q1024) is timed
    assert tune(cache, [(1, 1024)])[0]["config"] == {"tile": 32, "warps": 2} and timer.calls == 3 * MAX_CANDIDATES
    # a serving process (default mode, never times) picks the winner up at its first step
    serving = _cache(tmp_path, Autotuner("meta", timer=Timer(), directory=tmp_path, progress=False))
    serving.add("a")
    serving.plan_step(["a"], [600])
    serving.plan_step(["a"], [1])
    assert serving.step.configs == {"decode": {"tile": 32, "warps": 2}} and serving.autotuner.timer.calls == 0


def test_tune_needs_a_gpu(tmp_path):
    cache = _cache(tmp_path, Autotuner("meta", directory=tmp_path))
    with pytest.raises(KvgenRuntimeError, match="CUDA GPU"):
        tune(cache, [(1, 64)])


@pytest.mark.parametrize("scheme,sizes", [("int4", (32, 4096)), ("int4", (1, 16384)), ("int8", (32, 2048))])
def test_tuning_times_another_warp_count(scheme, sizes):
    """The CUDA decode offers 4 and 8 warps and three depths; the distance ranks every depth ahead of 8 warps, yet
    8 warps wins for KIVI at one split (H200, 2026-12-03-nvidia-h200-6/splits): tuning must time it."""
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    spec = KernelSpec(op="decode", scheme=scheme, head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch="sm_90", backend="cuda")
    mod = load_kernel(spec, default_registry().schemes[scheme])
    ranked = ranked_candidates("decode", mod, sizes, H200_SMS)
    assert ranked[0] == model_config("decode", mod, sizes, H200_SMS) and ranked[0]["num_warps"] == 4
    assert {c["num_warps"] for c in ranked} == {4, 8}
    assert len(ranked) <= MAX_CANDIDATES and all(valid_config(c, mod, sizes) for c in ranked)
