"""Issue 13 item 4: tuning can never break plan_step, cached winners are checked, and keyed by the template.

- An autotune cache that cannot be written (a file where the folder should be,
  a read-only home) is one warning; plan_step still reserves exactly once.
- A persisted entry that is not one of the kernel's candidates
  (``pages_per_tile=3``, ``"x"``, ``null``, ...) is ignored, retuned and overwritten.
- The key covers the template hash of the generated module, so a module
  rendered from other templates (an upgrade) never reuses an old winner.
"""

from __future__ import annotations

import importlib.util
import io
import json
import types
import warnings

import pytest
import torch

from kvgen.runtime.autotune import Autotuner
from .test_autotune import first_reading

CANDIDATES = [{"num_splits": s, "pages_per_tile": p, "num_warps": w, "num_stages": 2}
              for s in (1, 2) for p in (2, 4) for w in (4, 8)]  # 8: all are timed
BEST = {"num_splits": 2, "pages_per_tile": 4, "num_warps": 8, "num_stages": 2}


def decode_like(name: str = "fake_decode") -> types.ModuleType:
    """A module shaped like a generated decode kernel: candidates over splits x tile pages x warps."""
    m = types.ModuleType(name)
    m.MAX_SPLITS = 128
    m.default_config = lambda *shape, device=None: dict(CANDIDATES[0])
    m.candidates = lambda *shape: [dict(c) for c in CANDIDATES]
    return m


def cost(cfg: dict) -> float:
    return sum(abs(cfg[k] - BEST[k]) for k in BEST) + 1.0


class Timer:
    def __init__(self):
        self.calls = 0

    def __call__(self, fn):
        self.calls += first_reading(self, fn)
        return fn()


def bench(cfg):
    return lambda: cost(cfg)


def tuner(directory, timer=None) -> Autotuner:
    return Autotuner("cpu", force=True, timer=timer or Timer(), directory=directory, stream=io.StringIO())


# -- an unwritable cache ------------------------------------------------------------
def _plan():
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    plan = make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(context=4096),
                     default_registry().schemes, kv="int8").to_json()
    plan["kernels"] = {"decode": {"hash": "deadbeefdeadbeef"}, "prefill": {"hash": "0123456789abcdef"}}
    return plan


def _fake_kernels():
    mods = {}
    for op in ("decode", "prefill", "cache_write", "page_copy", "page_quantize", "dequant"):
        m = decode_like(f"fake_unwritable_{op}")
        m.launch = lambda *args, **kwargs: cost(kwargs["config"]) if kwargs.get("config") else 0.0
        mods[op] = m
    return mods


def _unwritable_file(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("the user's file\n")
    return blocker


def _read_only_home(tmp_path, monkeypatch):
    import kvgen.runtime.atomic_io as atomic_io  # the autotune store writes through it

    def deny(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(atomic_io.os, "replace", deny)
    return tmp_path


@pytest.mark.parametrize("make_dir", [_unwritable_file, _read_only_home], ids=["cache-dir-is-a-file", "read-only"])
def test_unwritable_cache_keeps_plan_step_all_or_nothing(tmp_path, monkeypatch, make_dir):
    from kvgen.runtime import load

    directory = make_dir(tmp_path, monkeypatch) if make_dir is _read_only_home else make_dir(tmp_path)
    timer = Timer()
    t = Autotuner("meta", force=True, timer=timer, directory=directory, progress=False)
    cache = load(_plan(), _fake_kernels(), device="meta", max_tokens=4096, num_layers=1, autotuner=t)
    cache.add("a")
    cache.add("b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.plan_step(["a", "b"], [100, 30])  # prefill bucket: tuned, cannot be saved
        cache.plan_step(["a", "b"], [1, 1])     # decode bucket: tuned, cannot be saved either
    assert [cache.seq_len("a"), cache.seq_len("b")] == [101, 31]  # each step reserved exactly once
    assert cache.step.configs == {"decode": BEST}
    assert t.origin("prefill", cache.kernels["prefill"], (2, 100, 100), "0123456789abcdef") == "tuned"
    ours = [w for w in caught if "kvgen autotune" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)  # once, not per bucket
    assert "KVGEN_CACHE_DIR" in str(ours[0].message)
    calls = timer.calls
    cache.plan_step(["a", "b"], [1, 1])  # the winner is remembered in memory: no retuning
    assert timer.calls == calls
    if make_dir is _unwritable_file:
        assert directory.read_text() == "the user's file\n"  # nothing of the user's touched


# -- invalid persisted entries -----------------------------------------------------------
def _poison(tmp_path, config) -> None:
    files = list((tmp_path / "autotune").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    (entry,) = data["entries"].values()
    entry["config"] = config
    files[0].write_text(json.dumps(data))


@pytest.mark.parametrize("bad", [
    dict(BEST, pages_per_tile=3),      # not a tile the kernel offers (tl.arange needs a power of two)
    dict(BEST, pages_per_tile="x"),
    dict(BEST, pages_per_tile=None),
    dict(BEST, num_warps=True),
    dict(BEST, num_splits=0),
    dict(BEST, block_m=16),            # a key the kernel does not take
    {k: v for k, v in BEST.items() if k != "num_warps"},
], ids=["ppt3", "str", "null", "bool", "splits0", "extra-key", "missing-key"])
def test_invalid_cached_entry_is_ignored_and_retuned(tmp_path, bad):
    mod = decode_like()
    assert tuner(tmp_path).config("decode", mod, (4, 256), bench, kernel_hash="c0ffee00c0ffee00") == BEST
    _poison(tmp_path, bad)
    timer = Timer()
    got = tuner(tmp_path, timer).config("decode", mod, (4, 256), bench, kernel_hash="c0ffee00c0ffee00")
    assert got == BEST and timer.calls == len(CANDIDATES)  # retuned, not launched with the bad entry
    (path,) = (tmp_path / "autotune").glob("*.json")
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["config"] == BEST  # and overwritten


def test_valid_config_against_a_rendered_decode_kernel():
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry
    from kvgen.runtime.autotune_model import valid_config

    spec = KernelSpec(op="decode", scheme="int8", head_dim=64, num_kv_heads=2, gqa_group=4, page_size=16,
                      compute_dtype="float16", arch="cpu")
    mod = load_kernel(spec, default_registry().schemes["int8"])
    sizes = (8, 1024)
    for cfg in mod.candidates(*sizes):
        assert valid_config(cfg, mod, sizes)
    good = mod.candidates(*sizes)[0]
    assert valid_config(dict(good, num_splits=mod.MAX_SPLITS), mod, sizes)  # splits are a runtime argument
    for bad in (dict(good, pages_per_tile=3), dict(good, num_warps="x"), dict(good, num_stages=None),
                dict(good, num_splits=mod.MAX_SPLITS + 1), "x", None, {}):
        assert not valid_config(bad, mod, sizes)


# -- the template hash is part of the key ---------------------------------------------------
MODULE_SOURCE = '''# Generated by kvgen 0.0.0 -- do not edit; edit the templates and recompile.
# template-hash: {tag}
# spec: {{"op": "decode"}}
MAX_SPLITS = 128
CANDIDATES = {cands!r}
def default_config(batch, seq, device=None):
    return dict(CANDIDATES[0])
def candidates(batch, seq):
    return [dict(c) for c in CANDIDATES]
'''


def _module_from(tmp_path, tag: str) -> types.ModuleType:
    path = tmp_path / f"decode_{tag}.py"
    path.write_text(MODULE_SOURCE.format(tag=tag, cands=CANDIDATES))
    spec = importlib.util.spec_from_file_location(f"decode_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_other_templates_never_reuse_a_winner(tmp_path):
    cache_dir = tmp_path / "cache"
    old, new = _module_from(tmp_path, "aaaaaaaaaaaaaaaa"), _module_from(tmp_path, "bbbbbbbbbbbbbbbb")
    first = Timer()
    tuner(cache_dir, first).config("decode", old, (4, 256), bench, kernel_hash="feedfacefeedface")
    assert first.calls == len(CANDIDATES)
    same = Timer()
    tuner(cache_dir, same).config("decode", old, (4, 256), bench, kernel_hash="feedfacefeedface")
    assert same.calls == 0  # the same kernel from the same templates: reused
    upgraded = Timer()  # same KernelSpec hash in plan.json, rendered from other templates
    tuner(cache_dir, upgraded).config("decode", new, (4, 256), bench, kernel_hash="feedfacefeedface")
    assert upgraded.calls == len(CANDIDATES)
    assert len(list((cache_dir / "autotune").glob("feedfacefeedface*.json"))) == 2


def test_a_failing_kernel_module_never_breaks_plan_step(tmp_path):
    from kvgen.runtime import load

    kernels = _fake_kernels()

    def broken(*shape):
        raise RuntimeError("a candidates() bug")

    kernels["decode"].candidates = broken
    t = Autotuner("meta", force=True, timer=Timer(), directory=tmp_path, progress=False)
    cache = load(_plan(), kernels, device="meta", max_tokens=4096, num_layers=1, autotuner=t)
    cache.add("a")
    with pytest.warns(RuntimeWarning, match="choosing a decode config failed"):
        step = cache.plan_step(["a"], [1])
    assert cache.seq_len("a") == 1 and step.configs == {"decode": None}  # launch uses its own default
