"""Load-time kernel warm-up (issue 13 item 12): which variants it enumerates, that it runs them through the
normal launch path, that it is skipped on the CPU and can be turned off, and that it never changes the cache.

On e6ec643 there was no warm-up (kvgen.runtime.warmup does not exist): the first step of every new shape
compiled its kernels while the request waited (0.96-2.5 s on the H200).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvgen.runtime import COMPRESSED, RESIDUAL, load
from kvgen.runtime.autotune import bucket
from kvgen.runtime.autotune_model import model_config
from kvgen.runtime.warmup import SPLIT_COUNTS, WARM_BATCH, decode_variants, scenarios, warm_up
from .test_runtime import kernels_for, make_cache, make_plan_for

H200_SMS = 132


def _as_on_h200(monkeypatch, cache):
    """The cache's autotuner returns the decode model's configs, as on an H200 (this runs on the CPU)."""
    def default(module, shape, op=""):
        return model_config(op, module, tuple(bucket(n) for n in shape), H200_SMS)
    monkeypatch.setattr(cache.autotuner, "default", default)


def _persist(cache, op, key, config):
    tuner = cache.autotuner
    ident = tuner.identity(cache.kernels[op], cache._hashes.get(op))
    tuner._save(ident, key, {"config": config, "ms": 0.01, "candidates": 3, "seconds": 1.0})


def test_scenarios_cover_every_variant_the_tuner_can_pick(monkeypatch):
    cache = make_cache("fp32", max_tokens=256, num_layers=1)
    _as_on_h200(monkeypatch, cache)
    model = {k: v for k, v in model_config("decode", cache.kernels["decode"], (8, 1024), H200_SMS).items()
             if k != "num_splits"}
    assert decode_variants(cache) == [model]  # one compiled variant for every bucket: the model's
    # a winner tuned earlier with another tile and warps is a second variant to build
    other = dict(model, pages_per_tile=2, num_warps=8, num_splits=5)
    _persist(cache, "decode", "decode/b8/s1024", other)
    _persist(cache, "decode", "decode/b2/s64", {"num_splits": 1, "bogus": 1})  # invalid: ignored
    variants = decode_variants(cache)
    assert variants == [model, {k: v for k, v in other.items() if k != "num_splits"}]

    got = scenarios(cache)
    decode = [s for s in got if s.op == "decode"]
    for v in variants:
        splits = sorted(s.config["num_splits"] for s in decode
                        if s.batch == WARM_BATCH and {k: x for k, x in s.config.items() if k != "num_splits"} == v)
        assert splits == [1, *SPLIT_COUNTS]  # direct, a plain split count, one divisible by 16
    for s in decode:
        tiles = -(-(s.context + 1) // (cache.page_size * s.config["pages_per_tile"]))
        assert tiles >= s.config["num_splits"]  # the launch keeps the split count (it caps it at the tiles)
        assert -(-(s.context + 1) // cache.page_size) % 16 != 0  # block tables of a common width class
    assert any(s.fork for s in decode)  # page_copy through copy-on-write
    assert {s.batch for s in decode} >= {1, WARM_BATCH, 16}  # cache_write of 1, a few and 16 tokens
    # every cache_write config (tokens per program...) its default can pick, with counts % 16 and not
    cw = cache.kernels["cache_write"].default_config
    writes = {s.batch * s.context for s in got} | {s.batch * s.new_tokens for s in got}
    for n in (1, 64, 4096, 1 << 16):
        assert any(cw(m) == cw(n) and m % 16 for m in writes if m)
        assert any(cw(m) == cw(n) and m % 16 == 0 for m in writes if m)
    # prefill: every compiled variant of its default over the buckets, plus persisted winners
    prefill = [s.config for s in got if s.op == "prefill"]
    module = cache.kernels["prefill"]
    defaults = {json.dumps(model_config("prefill", module, (b, q, s), H200_SMS), sort_keys=True)
                for b in (1, 8, 64) for q in (1, 16, 256) for s in (256, 1024)}
    assert defaults <= {json.dumps(c, sort_keys=True) for c in prefill}
    runs = [(json.dumps(s.config, sort_keys=True), s.batch, s.mixed) for s in got if s.op == "prefill"]
    assert len(runs) == len(set(runs))
    assert_in_place_configs_run_skipping(cache, got)


def assert_in_place_configs_run_skipping(cache, got):
    """Each config a step reads in place also runs beside a row it skips (the in-place kernel's SKIP_STAGED
    variant): in a mixed scenario (a decode row), or as the in-place twin of a two-sequence staging one."""
    module = cache.kernels["prefill"]
    prefill = [s for s in got if s.op == "prefill"]
    alone = [s.config for s in prefill if s.batch == 1 and not s.config.get("staged")]
    twins = [module.in_place_config(s.config) for s in prefill if s.batch == 2 and s.config.get("stage_rows") == [0]]
    skipping = [s.config for s in prefill if s.mixed] + [{k: v for k, v in c.items() if k != "stage_rows"}
                                                         for c in twins]
    assert alone and all(c in skipping for c in alone)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_scenarios_of_a_stageable_cache_run_every_in_place_config_skipping(scheme, monkeypatch):
    cache = make_cache(scheme, max_tokens=256, num_layers=1)
    _as_on_h200(monkeypatch, cache)
    assert cache.kernels["prefill"].STAGEABLE
    assert_in_place_configs_run_skipping(cache, scenarios(cache))


def test_a_staged_prefill_winner_warms_both_kernels_it_can_launch(monkeypatch, tmp_path):
    """``staged`` 2 picks per step between in place and staging, and a mixed step stages only some sequences:
    warm-up compiles every kernel variant this can launch, each for real."""
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "kvgen"))
    cache = make_cache("int4", max_tokens=256, num_layers=1)
    module = cache.kernels["prefill"]
    assert module.STAGEABLE
    # the tuner's staged candidate (staging decided per step) won
    winner = next(c for c in module.candidates(8, 256, 1024) if c.get("staged") == 2)
    _persist(cache, "prefill", "prefill/b8/q256/s1024", winner)
    # in place, the winner runs with the in-place tile (its own 128-token tile would spill dequantized there)
    in_place = module.in_place_config(winner)
    assert in_place["pages_per_tile"] <= winner["pages_per_tile"] and in_place["staged"] == 0
    assert module.step_config(winner, [4], [256], fresh=True) == in_place  # a short chunk: in place
    assert module.step_config(winner, [256], [1024], fresh=True) == dict(winner, staged=1, stage_rows=(0,))  # long
    staged, mixed = dict(winner, staged=1), dict(winner, staged=1, stage_rows=[0])
    # a winner for 2-token chunks (one query block: step_config never stages it) warms only its in-place twin
    short = next(c for c in module.candidates(8, 2, 1024) if c.get("staged") == 2)
    assert short["block_m"] < winner["block_m"]
    _persist(cache, "prefill", "prefill/b8/q2/s1024", short)
    prefill = [s for s in scenarios(cache) if s.op == "prefill"]
    assert not [s for s in prefill if s.config.get("staged") and s.config["block_m"] == short["block_m"]]
    assert [(s.batch, s.mixed) for s in prefill if s.config == module.in_place_config(short)] == [(1, False),
                                                                                                (2, True)]
    todo = [s for s in prefill if s.config in (in_place, staged, mixed) and not s.mixed]
    assert sorted((s.config["staged"], s.batch) for s in todo) == [(0, 1), (1, 1), (1, 2)]
    launches = []  # (kernel, SKIP_STAGED) of every attention launch

    def spy(name):
        kernel = getattr(module, name)

        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launches.append((name, kwargs.get("SKIP_STAGED")))
                    return kernel[grid](*args, **kwargs)
                return run
        monkeypatch.setattr(module, name, Spy())
    spy("_prefill_kernel")
    spy("_prefill_staged_kernel")
    report = warm_up(cache, force=True, only=todo)
    assert report.skipped is None
    assert sorted(launches) == [("_prefill_kernel", False), ("_prefill_kernel", True),
                                ("_prefill_staged_kernel", None), ("_prefill_staged_kernel", None)]


def test_a_mixed_scenario_runs_the_decode_kernel_and_the_skipping_prefill(monkeypatch, tmp_path):
    """A chunk beside a decode row: the decode kernel attends the row, the in-place kernel skips it."""
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "kvgen"))
    cache = make_cache("int8", max_tokens=256, num_layers=1)
    mixed = [s for s in scenarios(cache) if s.op == "prefill" and s.mixed]
    assert mixed and all(s.batch == 2 and not s.config.get("staged") for s in mixed)
    module, launches = cache.kernels["prefill"], []
    kernel, decode = module._prefill_kernel, cache.kernels["decode"].launch

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append(("prefill", kwargs.get("SKIP_STAGED")))
                return kernel[grid](*args, **kwargs)
            return run
    monkeypatch.setattr(module, "_prefill_kernel", Spy())
    monkeypatch.setattr(cache.kernels["decode"], "launch",
                        lambda q, *a, **k: launches.append(("decode", q.shape[0])) or decode(q, *a, **k))
    assert warm_up(cache, force=True, only=mixed[:1]).skipped is None
    assert launches == [("decode", 1), ("prefill", True)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_staged_tile_is_not_run_in_place(scheme):
    """bf16 compute, D=128: the staged candidate's 128-token, 3-stage tile runs staged; read in place, the
    in-place default's tile (a dequantized float32 tile that wide spills on sm_90)."""
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    spec = KernelSpec(op="prefill", scheme=scheme, head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch="sm_90")
    module = load_kernel(spec, default_registry().schemes[scheme])
    staged, in_place_default = module.candidates(4, 8192, 8192)[:2]
    assert staged == module.default_config(4, 8192, 8192, "cuda")  # the default stages per step
    assert staged["staged"] == 2 and staged["pages_per_tile"] * 16 == 128 and staged["num_stages"] == 3
    assert in_place_default["staged"] == 0 and in_place_default["pages_per_tile"] * 16 == 32
    in_place = module.in_place_config(staged)
    assert in_place == dict(staged, staged=0, pages_per_tile=in_place_default["pages_per_tile"],
                            num_stages=in_place_default["num_stages"])
    assert module.step_config(staged, [8], [8192], fresh=True) == in_place
    assert module.in_place_config(in_place_default) == in_place_default  # an in-place config is left alone


def _state(cache):
    bm = cache.block_manager
    free = (bm.num_free_pages(COMPRESSED), bm.num_free_pages(RESIDUAL) if cache.num_residual_pages else None)
    return ([(s, bm.block_table(s), bm.seq_len(s), bm.num_compressed(s)) for s in bm.sequences()], free,
            cache.step)


@pytest.mark.parametrize("scheme", ["fp32", "int4"])  # int4 keeps a residual window: page_quantize too
def test_warm_up_runs_the_normal_launch_path_and_never_changes_the_cache(scheme, monkeypatch, tmp_path):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "kvgen"))
    cache = make_cache(scheme, max_tokens=256, num_layers=1)
    cache.add("a")
    cache.plan_step(["a"], 20)
    cache.append_kv(0, ["a"], torch.randn(20, cache.num_kv_heads, cache.head_dim),
                    torch.randn(20, cache.num_kv_heads, cache.head_dim))
    before = _state(cache)
    pools = {n: t.clone() for n, t in cache.pools[0].items()}
    calls: list[tuple[str, dict | None]] = []
    for op, module in cache.kernels.items():
        original = module.launch

        def launch(*args, _op=op, _original=original, **kwargs):
            calls.append((_op, kwargs.get("config")))
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, "launch", launch)
    # everything but the 16-split fill (4 x 1024 tokens: minutes in the interpreter) runs for real
    todo = [s for s in scenarios(cache) if s.context < 512]
    report = warm_up(cache, force=True, only=todo)
    assert report.skipped is None and report.scenarios == todo
    ops = {op for op, _ in calls}
    want = {"decode", "prefill", "cache_write", "page_copy"} | ({"page_quantize"} if scheme == "int4" else set())
    assert want <= ops
    decode_splits = {cfg["num_splits"] for op, cfg in calls if op == "decode"}
    assert decode_splits == {1, 3}
    assert [cfg for op, cfg in calls if op == "prefill"] == [s.config for s in todo if s.op == "prefill"]
    # the cache is as it was: same sequences, pages, free lists and step; its pools untouched
    assert _state(cache) == before and cache.step is before[2]
    assert all(torch.equal(pools[n].view(torch.uint8), t.view(torch.uint8)) for n, t in cache.pools[0].items())
    assert not list((tmp_path / "kvgen").rglob("*.json"))  # the scratch tuner persists nothing
    cache.plan_step(["a"], 1)  # and the cache goes on working
    cache.decode(0, torch.randn(1, cache.num_q_heads, cache.head_dim), ["a"],
                 torch.randn(1, cache.num_kv_heads, cache.head_dim), torch.randn(1, cache.num_kv_heads, cache.head_dim))


def test_warm_up_is_skipped_on_the_cpu_and_launches_nothing(monkeypatch):
    cache = make_cache("fp32", max_tokens=256, num_layers=1)
    for module in cache.kernels.values():
        monkeypatch.setattr(module, "launch", lambda *a, **k: pytest.fail("warm-up launched a kernel on the CPU"))
    report = warm_up(cache)
    assert report.skipped and "interpreter" in report.skipped and report.scenarios == []


def test_load_warms_up_unless_turned_off(monkeypatch):
    import kvgen.runtime.warmup as warmup_mod
    seen = []
    monkeypatch.setattr(warmup_mod, "warm_up", lambda cache: seen.append(cache) or warmup_mod.WarmupReport(1.0))
    plan, kernels = make_plan_for("fp32").to_json(), kernels_for("fp32")
    cache = load(plan, kernels, device="cpu", max_tokens=64, num_layers=1)
    assert seen == [cache] and cache.warmup_report.seconds == 1.0
    assert load(plan, kernels, device="cpu", max_tokens=64, num_layers=1, warmup=False).warmup_report.skipped
    monkeypatch.setenv("KVGEN_WARMUP", "0")
    assert "turned off" in load(plan, kernels, device="cpu", max_tokens=64, num_layers=1).warmup_report.skipped
    assert len(seen) == 1
    monkeypatch.setenv("KVGEN_WARMUP", "1")

    def broken(cache):
        raise RuntimeError("ptxas died")
    monkeypatch.setattr(warmup_mod, "warm_up", broken)
    with pytest.warns(RuntimeWarning, match="warm-up failed .*ptxas died"):
        cache = load(plan, kernels, device="cpu", max_tokens=64, num_layers=1)
    assert "ptxas died" in cache.warmup_report.skipped
    assert cache.sequences() == []  # a usable cache all the same
