"""Runtime misuse (issue 13, items 8 and 13): every mistake a caller can make is a one-line KvgenRuntimeError.

Each test here was accepted silently, or ended in a raw exception, on e6ec643:
float token ids were truncated (so ``[1.7]`` and ``[1]`` shared a prefix
hash), a str of sequence ids split into characters, complex K/V were cast, a
step planned before ``free()`` still wrote into the freed pages; an
unhashable id, token ids ``"hello"``, a list or meta tensor as k/v and a
wrong ``out=`` raised TypeError/AttributeError/NotImplementedError from deep
inside; ``load()`` on the CPU without ``TRITON_INTERPRET=1`` failed only at
the first kernel with Triton's "0 active drivers".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvgen.runtime import COMPRESSED, KvgenRuntimeError
from .test_runtime import HQ, D, H, make_cache


def state(cache):
    bm = cache.block_manager
    return ([(s, bm.block_table(s), bm.seq_len(s)) for s in bm.sequences()], bm.num_free_pages(COMPRESSED),
            cache.step)


@pytest.fixture(scope="module")
def base():
    return make_cache("fp32", max_tokens=256, num_layers=1)


@pytest.fixture
def cache(base):
    for sid in base.sequences():
        base.free(sid)
    base.step = None
    base.add("a")
    base.add("b")
    return base


def test_float_token_ids_are_refused_not_truncated(cache):
    before = state(cache)
    with pytest.raises(KvgenRuntimeError, match=r"token ids must be ints, got 1\.7"):
        cache.add("x", [1.7])
    with pytest.raises(KvgenRuntimeError, match="token ids must be ints"):
        cache.plan_step(["a"], [1], token_ids=[[1.0]])
    with pytest.raises(KvgenRuntimeError, match="token ids must be ints"):
        cache.add("x", torch.tensor([1.5, 2.0]))
    assert state(cache) == before
    assert cache.add("x", torch.tensor([1, 2])) == 0  # integer tensors are fine


def test_token_ids_none_or_a_string(cache):
    assert cache.add("n", None) == 0  # None: no token ids, as for plan_step
    for bad in ("hello", b"hi", 7):
        with pytest.raises(KvgenRuntimeError, match="token ids must be a list of ints"):
            cache.add("h", bad)
    with pytest.raises(KvgenRuntimeError, match="token ids must be a list of ints"):
        cache.plan_step(["a"], [5], token_ids=["hello"])
    with pytest.raises(KvgenRuntimeError, match="one list of ids"):
        cache.plan_step(["a"], [2], token_ids="ab")
    assert "h" not in cache.sequences() and cache.seq_len("a") == 0


def test_a_string_is_not_a_list_of_sequence_ids(cache):
    before = state(cache)
    with pytest.raises(KvgenRuntimeError, match="got the string 'ab'"):
        cache.plan_step("ab", 1)
    assert state(cache) == before
    cache.plan_step(["a", "b"], [1, 1])
    k = torch.zeros(2, H, D)
    with pytest.raises(KvgenRuntimeError, match="got the string 'ab'"):
        cache.append_kv(0, "ab", k, k)


def test_unhashable_sequence_ids(cache):
    before = state(cache)
    for call in (lambda: cache.add(["x"]), lambda: cache.fork("a", ["x"]), lambda: cache.fork(["a"], "x"),
                 lambda: cache.free({"a": 1}), lambda: cache.seq_len(["a"]),
                 lambda: cache.plan_step([["a"]], [1])):
        with pytest.raises(KvgenRuntimeError, match="sequence ids must be hashable"):
            call()
    assert state(cache) == before


def test_kv_must_be_real_float_tensors_with_data(cache):
    cache.plan_step(["a", "b"], [1, 1])
    k = torch.randn(2, H, D)
    with pytest.raises(KvgenRuntimeError, match="k must be a torch.Tensor"):
        cache.append_kv(0, None, k.tolist(), k)
    with pytest.raises(KvgenRuntimeError, match="real floating-point"):
        cache.append_kv(0, None, k.to(torch.complex64), k)
    with pytest.raises(KvgenRuntimeError, match="real floating-point"):
        cache.append_kv(0, None, k, k.to(torch.int32))
    with pytest.raises(KvgenRuntimeError, match="meta tensor"):
        cache.append_kv(0, None, k, torch.empty(2, H, D, device="meta"))
    with pytest.raises(KvgenRuntimeError, match="q must be a torch.Tensor"):
        cache.decode(0, 3.0, None, k, k)
    assert cache.step.written == set()  # nothing was written by the refused calls
    cache.append_kv(0, None, k, k)


def test_out_must_match_q(cache):
    cache.plan_step(["a", "b"], [1, 1])
    k = torch.randn(2, H, D)
    q = torch.randn(2, HQ, D)
    cache.append_kv(0, None, k, k)
    for bad in (torch.empty(2, HQ, D + 1), torch.empty(2, HQ, D, dtype=torch.float16),
                torch.empty(2, D, HQ).transpose(1, 2), "out"):
        with pytest.raises(KvgenRuntimeError, match="out must be a contiguous"):
            cache.decode(0, q, None, out=bad)
    out = torch.full((2, HQ, D), float("nan"))
    assert cache.decode(0, q, None, out=out) is out and torch.isfinite(out).all()
    with pytest.raises(KvgenRuntimeError, match="out must be"):
        cache.prefill(0, q, None, None, out=torch.empty(3, HQ, D))


def test_a_step_planned_before_free_cannot_run(cache):
    cache.plan_step(["a", "b"], [2, 1])
    cache.free("a")
    k = torch.randn(3, H, D)
    with pytest.raises(KvgenRuntimeError, match="'a' was freed after this step was planned"):
        cache.append_kv(0, None, k, k)
    with pytest.raises(KvgenRuntimeError, match="freed after this step"):
        cache.prefill(0, torch.randn(3, HQ, D), k, k)
    cache.plan_step(["b"], [1])  # a new plan for the live sequences runs
    out = cache.decode(0, torch.randn(1, HQ, D), ["b"], k[:1], k[:1])
    assert torch.isfinite(out).all()
    cache.add("c")
    cache.plan_step(["c"], [1])
    cache.free("b")  # not in the planned step: the step stays usable
    assert torch.isfinite(cache.decode(0, torch.randn(1, HQ, D), ["c"], k[:1], k[:1])).all()


def test_repr_says_what_the_cache_holds(cache):
    text = repr(cache)
    for part in ("KVCache(", "scheme='fp32'", f"page_size={cache.page_size}", f"head_dim={D}",
                 f"/{cache.num_pages} free", "sequences=2", "device=cpu", "float32"):
        assert part in text, (part, text)
    assert "residual" not in text
    assert "sequences=2" in repr(cache.block_manager) and "BlockManager(" in repr(cache.block_manager)
    residual = make_cache("int4:residual=32", max_tokens=256, num_layers=1)
    assert "residual_tokens=32" in repr(residual) and f"/{residual.num_residual_pages} free" in repr(residual)


CPU_WITHOUT_INTERPRETER = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
from kvgen.runtime import KvgenRuntimeError, load
from tests.test_runtime import kernels_for, make_plan_for
plan = make_plan_for("fp32").to_json()
kernels = kernels_for("fp32")
for attempt in ("unset", "set after import"):
    try:
        load(plan, kernels, device="cpu", max_tokens=64, num_layers=1, autotune=False)
        print(attempt, "loaded")
    except KvgenRuntimeError as e:
        print(attempt, "KvgenRuntimeError", e)
    os.environ["TRITON_INTERPRET"] = "1"
'''


def test_cpu_without_the_interpreter_says_what_to_do(tmp_path):
    """Item 13: load() on the CPU without TRITON_INTERPRET=1 fails at once, saying what to set."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the tests package
    proc = subprocess.run([sys.executable, "-c", CPU_WITHOUT_INTERPRETER, root], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("unset KvgenRuntimeError") and "TRITON_INTERPRET is not set" in lines[0]
    assert "set TRITON_INTERPRET=1" in lines[0] and "CUDA device" in lines[0]
    # Set only after the kernels were imported: Triton compiled them already, so it still cannot run.
    assert lines[1].startswith("set after import KvgenRuntimeError") and "imported without it" in lines[1]


def test_a_bare_cuda_device_is_indexed(monkeypatch):
    """``device="cuda"`` (as the engine passes it) becomes ``cuda:<current>``: torch.Generator, which the
    load-time warm-up makes per scenario, refuses a device without an index (H200, 2026-12-01: every engine
    load warned "kernel warm-up failed ... Expected a torch.device with a specified index")."""
    import torch

    from kvgen.runtime.page_pool import _indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert _indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert _indexed(torch.device("cpu")) == torch.device("cpu")
