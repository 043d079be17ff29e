"""The runtime beyond its numerics: its layer ops never touch host data, the generated package runs without kvgen
installed, the step's metadata sections stay aligned, and a long chunk of a residual scheme takes few phases.

The numerics against float64 references are in test_runtime.py, whose helpers these tests share.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvgen.runtime import load
from kvgen.runtime.block_manager import BlockManager
from kvgen.runtime.page_pool import APPEND_SLACK_PAGES

from .test_runtime import HQ, SCHEMES, D, H, fake_kernels, make_cache, make_plan_for


# ------------------------------------------------------------------ no host synchronization


def test_layer_ops_never_touch_host_data():
    """With every tensor on the 'meta' device any .item()/.tolist()/.cpu() or branch on a value raises."""
    scheme = "int4" if "int4" in SCHEMES else "fp32"
    plan = make_plan_for(scheme)
    log: list = []
    cache = load(plan.to_json(), fake_kernels(log), device="meta", max_tokens=1024, autotune=False)
    cache.add("p")
    cache.plan_step(["p"], [15])
    for layer in range(cache.num_layers):
        cache.prefill(layer, torch.empty(15, HQ, D, device="meta"), torch.empty(15, H, D, device="meta"),
                      torch.empty(15, H, D, device="meta"), ["p"])
    cache.fork("p", "c")
    step = cache.plan_step(["p", "c"], [1, 1])
    assert step.block_tables.device.type == "meta" and step.slot_mapping.dtype == torch.int64
    assert step.num_copies == 1
    if scheme == "int4":
        assert step.num_conversions == 2  # both tails fill: 16 tokens
    log.clear()
    for layer in range(cache.num_layers):
        kv = torch.empty(2, H, D, device="meta")
        out = cache.decode(layer, torch.empty(2, HQ, D, device="meta"), ["p", "c"], kv, kv)
        assert out.shape == (2, HQ, D)
    for i, (op, args, _) in enumerate(log):  # every layer reads and writes its own pools
        layer = i // (len(log) // cache.num_layers)
        pools = args[0] if op == "page_copy" else args[2] if op in ("cache_write", "decode") else args[0]
        if op == "page_copy":
            assert all(t is cache.pools[layer][n] for t, n in zip(pools, ("rk", "rv")) if scheme == "int4")
        else:
            assert pools is cache.pools[layer]
    ops = [op for op, _, _ in log]
    # int4: the attention reads the step's tables before its conversions, which run after it (.preconversion)
    per_layer = ["page_copy", "cache_write", "decode"] + (["page_quantize"] if scheme == "int4" else [])
    assert ops == per_layer * cache.num_layers
    decode_call = [c for c in log if c[0] == "decode"][-1]
    assert decode_call[2]["config"]["op"] == "decode"
    # the step's tensors, not copies (int4: its pre-conversion view, computed once for every layer)
    assert decode_call[1][3] is (step.pre_view[0] if scheme == "int4" else step.block_tables)
    if scheme == "int4":
        assert decode_call[1][5] is step.pre_view[1]


# ------------------------------------------------------------------ the generated package stands alone

ISOLATED = '''
import importlib.abc, sys
class NoKvgen(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvgen" or name.startswith(("kvgen.", "kvgen_plugins", "kvgen_templates")):
            raise ImportError("kvgen is not installed here: " + name)
sys.meta_path.insert(0, NoKvgen())
sys.path.insert(0, sys.argv[1])
import torch
pkg = __import__(sys.argv[2])
cache = pkg.load(device="cpu", max_tokens=64, num_layers=1, autotune=False)
cache.add("a")
cache.plan_step(["a"], [3])
H, HQ, D = cache.num_kv_heads, cache.num_q_heads, cache.head_dim
out = cache.prefill(0, torch.randn(3, HQ, D), torch.randn(3, H, D), torch.randn(3, H, D), ["a"])
print(tuple(out.shape), bool(torch.isfinite(out).all()), any(m == "kvgen" or m.startswith("kvgen.") for m in sys.modules))
'''


def test_generated_package_runs_without_kvgen(tmp_path):
    import os
    import subprocess
    import sys

    from kvgen.codegen.package import compile_plan

    plan = make_plan_for("fp32")
    compile_plan(plan, out_dir=tmp_path / plan.name)
    for f in (tmp_path / plan.name / "runtime").glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+kvgen\b", f.read_text(), re.MULTILINE), f.name
    env = dict(os.environ, TRITON_INTERPRET="1", KVGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", ISOLATED, str(tmp_path), plan.name], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["(3,", f"{HQ},", f"{D})", "True", "False"]


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_step_metadata_sections_are_16_byte_aligned(batch):
    """Triton compiles a variant per pointer alignment: every section the kernels read starts 16-byte aligned,
    whatever the batch size and block-table width (else a new batch size could JIT-compile on a request's path)."""
    cache = make_cache("int8", num_layers=1)
    ids = list(range(batch))
    for i in ids:
        cache.add(i)
    step = cache.plan_step(ids, [3 + 17 * i for i in ids])
    for name in ("block_tables", "seq_lens", "num_compressed", "cu_seqlens_q"):
        assert getattr(step, name).data_ptr() % 16 == 0, name


def test_a_long_chunk_of_a_residual_scheme_takes_few_phases_with_one_sequence():
    """A prompt chunk of a residual scheme converts its full pages through the residual pool, one phase (a cache
    write and a page-quantize launch per layer) each time that pool runs dry: a cache sized for one sequence keeps
    spare residual pages (APPEND_SLACK_PAGES), so a 1,024-token chunk takes a few phases, not one per page."""
    plan = make_plan_for("int4")
    P = plan.page_size
    cache = load(plan.to_json(), fake_kernels([]), device="meta", max_tokens=1 << 16, max_seqs=1, autotune=False)
    per_seq = plan.scheme_params["residual_tokens"] // P + 1
    assert cache.num_residual_pages == per_seq + APPEND_SLACK_PAGES
    bm = cache.block_manager
    bm.add_sequence("a")
    phases = bm.reserve_step(["a"], [1024]).phases
    assert len(phases) <= -(-1024 // P // APPEND_SLACK_PAGES) + 1
    # without the slack (the pool of one tail) the same chunk took a phase per page
    lean = BlockManager(P, cache.num_pages, per_seq, plan.scheme_params["residual_tokens"], "int4")
    lean.add_sequence("a")
    assert len(lean.reserve_step(["a"], [1024]).phases) >= 1024 // P - 1
