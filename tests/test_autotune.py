"""The autotuner: bucketing, persistence (atomic, locked, merged), corrupt files, other processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

from kvgen.runtime.autotune import Autotuner, bucket, kernel_hash

REPO = Path(__file__).resolve().parents[1]


def fake_module(name: str = "fake_decode_kernel") -> types.ModuleType:
    m = types.ModuleType(name)
    m.default_config = lambda batch, seq, device=None: {"tile": 16, "warps": 4}
    m.candidates = lambda batch, seq: [{"tile": t, "warps": w} for t in (16, 32, 64) for w in (4, 8)]
    return m


def cost(cfg: dict) -> float:
    """A made-up timing with a unique minimum at tile 32, 8 warps."""
    return abs(cfg["tile"] - 32) / 16 + (0.5 if cfg["warps"] == 4 else 0.1)


def first_reading(timer, fn) -> int:
    """1 the first time ``timer`` times bench ``fn`` (a candidate's reading), 0 when the tuner times it again to
    confirm a front-runner (``CONFIRM_WITHIN``); ``timer.readings`` counts both."""
    seen = timer.__dict__.setdefault("seen", [])
    timer.readings = getattr(timer, "readings", 0) + 1
    if any(f is fn for f in seen):
        return 0
    seen.append(fn)
    return 1


class Timer:
    """Counts the candidates it timed (``calls``) and every reading (``readings``)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn):
        self.calls += first_reading(self, fn)
        return fn()


def bench(cfg):
    return lambda: cost(cfg)


def tuner(tmp_path, timer=None, **kw) -> Autotuner:
    return Autotuner("cpu", force=True, timer=timer or Timer(), directory=tmp_path, stream=io.StringIO(), **kw)


def test_bucket_rounds_up_to_powers_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000, 1024, 1025)] == [1, 1, 2, 4, 8, 8, 16, 1024, 1024, 2048]
    assert Autotuner.key("decode", (5, 1000)) == "decode/b8/s1024"
    assert Autotuner.key("prefill", (3, 17, 300)) == "prefill/b4/q32/s512"


def test_round_trip_with_fake_timer(tmp_path):
    timer = Timer()
    t = tuner(tmp_path, timer)
    mod = fake_module()
    cfg = t.config("decode", mod, (5, 1000), bench, kernel_hash="abcd1234abcd1234")
    assert cfg == {"tile": 32, "warps": 8}
    assert timer.calls == 6  # every candidate once (the default is one of them)
    ident = t.identity(mod, "abcd1234abcd1234")
    assert ident == "abcd1234abcd1234-src-none"  # spec hash + template tag (a file-less module has none)
    path = t.path(ident)
    data = json.loads(path.read_text())
    assert data["kernel_hash"] == ident and data["device"] == "cpu"
    assert data["entries"]["decode/b8/s1024"]["config"] == cfg
    assert data["entries"]["decode/b8/s1024"]["candidates"] == 6
    # same bucket, other exact sizes: no timing
    assert t.config("decode", mod, (7, 600), bench, kernel_hash="abcd1234abcd1234") == cfg
    assert timer.calls == 6
    # a fresh tuner (a new process, as far as the file knows) reuses the winner without timing
    timer2 = Timer()
    assert tuner(tmp_path, timer2).config("decode", mod, (8, 1024), bench, kernel_hash="abcd1234abcd1234") == cfg
    assert timer2.calls == 0
    # another bucket is tuned and merged into the same file
    tuner(tmp_path, timer2).config("decode", mod, (9, 1024), bench, kernel_hash="abcd1234abcd1234")
    assert timer2.calls == 6
    assert set(json.loads(path.read_text())["entries"]) == {"decode/b8/s1024", "decode/b16/s1024"}
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind


def test_progress_bar_is_plain_text(tmp_path):
    stream = io.StringIO()
    t = Autotuner("cpu", force=True, timer=Timer(), directory=tmp_path, stream=stream)
    t.config("decode", fake_module(), (2, 64), bench, kernel_hash="ff" * 8)
    text = stream.getvalue()
    assert "kvgen autotune decode/b2/s64" in text and "6/6" in text and text.endswith("\n")
    assert "\x1b[" not in text  # no terminal escape codes


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2, 3]", '{"format": 1, "entries": 7}', ""])
def test_corrupt_file_is_ignored_and_rewritten(tmp_path, garbage):
    t = tuner(tmp_path)
    path = t.path(t.identity(fake_module(), "c0ffee00c0ffee00"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(garbage)
    timer = Timer()
    t = tuner(tmp_path, timer)
    assert t.config("decode", fake_module(), (4, 256), bench, kernel_hash="c0ffee00c0ffee00") == {"tile": 32, "warps": 8}
    assert timer.calls == 6
    data = json.loads(path.read_text())
    assert data["entries"]["decode/b4/s256"]["config"] == {"tile": 32, "warps": 8}


def test_key_covers_device_and_triton_version(tmp_path):
    t = tuner(tmp_path)
    t.config("decode", fake_module(), (1, 16), bench, kernel_hash="1234567812345678")
    name = t.path(t.identity(fake_module(), "1234567812345678")).name
    assert name.startswith("1234567812345678-src-none__cpu__triton-")
    other = tuner(tmp_path, Timer())
    other.triton_version = "0.0.0"
    other.config("decode", fake_module(), (1, 16), bench, kernel_hash="1234567812345678")
    assert other.timer.calls == 6  # a different Triton never reuses another's winners


def test_kernel_hash_from_spec_header():
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    spec = KernelSpec(op="page_copy", scheme="fp32", head_dim=8, num_kv_heads=2, gqa_group=2, page_size=16,
                      compute_dtype="float32", arch="cpu")
    module = load_kernel(spec, default_registry().schemes["fp32"])
    assert kernel_hash(module) == spec.hash
    assert kernel_hash(module, "explicit") == "explicit"
    assert kernel_hash(fake_module("a")) != kernel_hash(fake_module("b"))


def test_interpreter_and_cpu_use_default_config(tmp_path):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    timer = Timer()
    t = Autotuner("cpu", timer=timer, directory=tmp_path)
    assert not t.should_tune()
    assert t.config("decode", fake_module(), (3, 100), bench) == {"tile": 16, "warps": 4}
    assert timer.calls == 0 and not t.root().exists()
    assert not Autotuner("cpu", enabled=False, force=True).should_tune()


def test_failing_candidates_are_skipped(tmp_path):
    def flaky(cfg):
        if cfg["tile"] == 32:
            raise RuntimeError("out of shared memory")
        return lambda: cost(cfg)

    cfg = tuner(tmp_path).config("decode", fake_module(), (1, 64), flaky, kernel_hash="0" * 16)
    assert cfg == {"tile": 16, "warps": 8}


SCRIPT = textwrap.dedent("""
    import json, sys, time, types
    from kvgen.runtime.autotune import Autotuner
    m = types.ModuleType("fake_decode_kernel")
    m.default_config = lambda batch, seq, device=None: {"tile": 16, "warps": 4}
    m.candidates = lambda batch, seq: [{"tile": t, "warps": w} for t in (16, 32, 64) for w in (4, 8)]
    calls = []  # the benches timed: a front-runner's confirming second reading times one again
    def timer(fn):
        calls.append(fn)
        time.sleep(0.02)
        return fn()
    def bench(cfg):
        return lambda: abs(cfg["tile"] - 32) / 16 + (0.5 if cfg["warps"] == 4 else 0.1)
    batch = int(sys.argv[1])
    t = Autotuner("cpu", force=True, timer=timer, progress=False)
    cfg = t.config("decode", m, (batch, 512), bench, kernel_hash="5ca1ab1e5ca1ab1e")
    print(json.dumps({"config": cfg, "calls": len({id(f) for f in calls})}))
""")


def run_script(tmp_path, *args, wait=True):
    env = dict(os.environ, KVGEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_loads_without_tuning(tmp_path):
    first = run_script(tmp_path, "4")
    assert first == {"config": {"tile": 32, "warps": 8}, "calls": 6}
    second = run_script(tmp_path, "3")  # same bucket (4)
    assert second == {"config": {"tile": 32, "warps": 8}, "calls": 0}
    # and this process, reading the default cache dir, agrees
    t = Autotuner("cpu", force=True, timer=Timer(), directory=tmp_path)
    m = types.ModuleType("fake_decode_kernel")
    assert t.cached(t.identity(m, "5ca1ab1e5ca1ab1e"))["decode/b4/s512"]["config"] == {"tile": 32, "warps": 8}


def test_concurrent_processes_merge_their_winners(tmp_path):
    procs = [run_script(tmp_path, str(b), wait=False) for b in (1, 8)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    files = list((tmp_path / "autotune").glob("5ca1ab1e5ca1ab1e-*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    assert set(entries) == {f"decode/b{b}/s512" for b in (1, 8)}


def _fake_kernels(log):
    mods = {}
    for op in ("decode", "prefill", "cache_write", "page_copy", "page_quantize", "dequant"):
        m = types.ModuleType(f"fake_tuned_{op}")
        m.default_config = lambda *shape, device=None: {"tile": 16, "warps": 4}
        m.candidates = lambda *shape: [{"tile": t, "warps": w} for t in (16, 32, 64) for w in (4, 8)]

        def launch(*args, op=op, **kwargs):
            log.append((op, kwargs.get("config")))
            return cost(kwargs["config"]) if kwargs.get("config") else 0.0

        m.launch = launch
        mods[op] = m
    return mods


def test_kvcache_plans_with_tuned_configs(tmp_path):
    """plan_step asks the autotuner once per bucket (keyed by plan.json's kernel hash) and launches with the winner."""
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.runtime import load
    from kvgen.targets import resolve_target

    plan = make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(context=4096),
                     default_registry().schemes, kv="int8").to_json()
    plan["kernels"] = {"decode": {"hash": "deadbeefdeadbeef"}, "prefill": {"hash": "0123456789abcdef"}}
    log: list = []
    timer = Timer()
    # (no time budget: this test is about which config wins, and a loaded CI machine once ran past the default 5 s)
    t = Autotuner("meta", force=True, timer=timer, directory=tmp_path, progress=False, budget_s=1e9)
    cache = load(plan, _fake_kernels(log), device="meta", max_tokens=4096, num_layers=1, autotuner=t)
    H, HQ, D = cache.num_kv_heads, cache.num_q_heads, cache.head_dim
    cache.add("a")
    cache.add("b")
    cache.plan_step(["a", "b"], [100, 30])
    assert cache.step.configs == {"prefill": {"tile": 32, "warps": 8}}
    assert timer.calls == 6
    cache.plan_step(["a", "b"], [1, 1])
    assert cache.step.configs == {"decode": {"tile": 32, "warps": 8}}
    assert timer.calls == 12
    kv = torch.empty(2, H, D, device="meta")
    log.clear()
    cache.decode(0, torch.empty(2, HQ, D, device="meta"), ["a", "b"], kv, kv)
    assert log[-1] == ("decode", {"tile": 32, "warps": 8})
    cache.plan_step(["a", "b"], [1, 1])  # same bucket: no timing
    assert timer.calls == 12
    kernels = cache.kernels
    assert t.path(t.identity(kernels["decode"], "deadbeefdeadbeef")).exists()
    assert t.path(t.identity(kernels["prefill"], "0123456789abcdef")).exists()


def test_files_of_an_earlier_format_are_left_alone_and_said_once(tmp_path):
    """A format-2 file (its name has no format suffix) is neither read nor overwritten; the first lookup that
    finds one warns once (kvgen tune must run again); the new file carries the format in its name."""
    import kvgen.runtime.autotune as at

    t = tuner(tmp_path)
    ident = t.identity(fake_module(), "feedfacefeedface")
    new = t.path(ident)
    assert new.name.endswith(f"__f{at.FORMAT}.json")
    old = new.with_name(new.name.replace(f"__f{at.FORMAT}.json", ".json"))
    old.parent.mkdir(parents=True, exist_ok=True)
    legacy = json.dumps({"format": 2, "kernel_hash": ident, "device": t.device_name, "triton": t.triton_version,
                         "entries": {"decode/b4/s256": {"config": {"tile": 16, "warps": 4}, "ms": 0.001}}})
    old.write_text(legacy)
    at._WARNED.discard(f"<outdated {t.root()}>")
    timer = Timer()
    t = tuner(tmp_path, timer)
    with pytest.warns(RuntimeWarning, match="earlier kvgen.* run kvgen tune again"):
        assert t.config("decode", fake_module(), (4, 256), bench, kernel_hash="feedfacefeedface") == {"tile": 32,
                                                                                                      "warps": 8}
    assert timer.calls == 6 and old.read_text() == legacy and new.is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuner(tmp_path, Timer()).config("decode", fake_module(), (8, 256), bench, kernel_hash="feedfacefeedface")


def test_a_file_of_another_suffixed_format_is_said_once_too(tmp_path):
    """A format-3 file (decode timed at the bucket's length alone) is not read either, and says so once."""
    import kvgen.runtime.autotune as at

    t = tuner(tmp_path)
    ident = t.identity(fake_module(), "cafecafecafecafe")
    old = t.path(ident).with_name(t.path(ident).name.replace(f"__f{at.FORMAT}.json", "__f3.json"))
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text(json.dumps({"format": 3, "kernel_hash": ident, "device": t.device_name,
                               "triton": t.triton_version, "entries": {}}))
    at._WARNED.discard(f"<outdated {t.root()}>")
    with pytest.warns(RuntimeWarning, match=f"format {at.FORMAT} now"):
        tuner(tmp_path, Timer()).config("decode", fake_module(), (4, 256), bench, kernel_hash="cafecafecafecafe")
    assert old.is_file()


def test_a_front_runner_read_slow_once_is_timed_again_and_wins(tmp_path):
    """The true best (tile 32, 8 warps: 0.1) is read 15% slow the first time, behind a runner-up at 0.11: the
    front-runners within CONFIRM_WITHIN are timed again and each keeps its faster reading, so the best wins. A
    candidate beyond the margin is never timed twice."""
    from kvgen.runtime import autotune

    readings = []

    def timer(fn):
        ms = fn()
        first = not any(f is fn for f, _ in readings)
        readings.append((fn, ms))
        return ms * 1.15 if first and ms == 0.1 else ms  # a slow stretch hits the best's only first reading

    def bench(cfg):
        return lambda: {(32, 8): 0.1, (32, 4): 0.11}.get((cfg["tile"], cfg["warps"]), 1.0)

    t = Autotuner("cpu", force=True, timer=timer, directory=tmp_path, stream=io.StringIO())
    assert t.config("decode", fake_module(), (4, 512), bench, kernel_hash="f00d" * 4) == {"tile": 32, "warps": 8}
    again = [ms for fn, ms in readings if sum(f is fn for f, _ in readings) == 2]
    assert sorted(set(again)) == [0.1, 0.11]  # the two front-runners, each timed twice; the 1.0s once
    assert len(readings) == 6 + 2 <= 6 + autotune.CONFIRM_MAX
    assert t.cached("f00d" * 4 + "-src-none")["decode/b4/s512"]["ms"] == 0.1  # its faster reading is kept


def _confirming_tuner(tmp_path, first_readings, second_readings, **kw):
    """A tuner over six candidates (tile x warps) whose bench returns its config's key; the timer reads each bench's
    first and second times from the two maps, advances a fake clock by 1 s a reading, and logs (key, ms)."""
    log, clock = [], [0.0]

    def timer(fn):
        key = fn()
        clock[0] += 1.0
        seen = sum(k == key for k, _ in log)
        ms = (first_readings if seen == 0 else second_readings)[key]
        log.append((key, ms))
        return ms

    def bench(cfg):
        return lambda: (cfg["tile"], cfg["warps"])

    t = Autotuner("cpu", force=True, timer=timer, directory=tmp_path, stream=io.StringIO(),
                  clock=lambda: clock[0], **kw)
    return t, bench, log


def test_confirmation_keeps_the_faster_reading_and_times_runners_up_first(tmp_path):
    """Four candidates within CONFIRM_WITHIN: the two nearest runners-up are timed again, then the fastest (three
    in all); the fourth is not. A second reading slower than the first leaves the first."""
    from kvgen.runtime import autotune

    first = {(16, 4): 1.00, (16, 8): 1.05, (32, 4): 1.10, (32, 8): 1.15, (64, 4): 2.0, (64, 8): 2.0}
    second = {k: v * 1.1 for k, v in first.items()}  # every second reading slower
    t, bench, log = _confirming_tuner(tmp_path, first, second, budget_s=100.0)
    assert t.config("decode", fake_module(), (4, 512), bench, kernel_hash="c0de" * 4) == {"tile": 16, "warps": 4}
    again = [k for k, _ in log[6:]]
    assert again == [(16, 8), (32, 4), (16, 4)] and len(again) == autotune.CONFIRM_MAX
    assert t.cached("c0de" * 4 + "-src-none")["decode/b4/s512"]["ms"] == 1.00  # the first, faster reading


def test_a_budget_that_leaves_one_confirmation_spends_it_on_the_nearest_runner_up(tmp_path):
    """1 s a reading and 7.5 s of budget: the six candidates take 6 s, and of the
    confirmations only one fits. It goes to the runner-up, the true best read 15% slow, which then wins."""
    first = {(16, 4): 1.10, (16, 8): 1.15, (32, 4): 2.0, (32, 8): 2.0, (64, 4): 2.0, (64, 8): 2.0}
    second = {(16, 4): 1.10, (16, 8): 1.00, (32, 4): 2.0, (32, 8): 2.0, (64, 4): 2.0, (64, 8): 2.0}
    t, bench, log = _confirming_tuner(tmp_path, first, second, budget_s=7.5)
    assert t.config("decode", fake_module(), (4, 512), bench, kernel_hash="beef" * 4) == {"tile": 16, "warps": 8}
    timed_once = {k for k, _ in log}
    assert len(log) == len(timed_once) + 1 and log[-1] == ((16, 8), 1.00)
