"""benchmarks/experiments/decode_variants.py's source transforms, run in the CPU emulation of the CUDA templates
(tests/cuda_emu): a variant the device session times must compute the same attention, or its timing means nothing
(the GPU run checks it again against the base, but a broken variant costs device minutes to find)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.experiments.decode_variants import (GRID_INDEX, GRID_LAUNCH, RESIDUAL_PASS, as_records,
                                                    record_layout, with_page_record, with_split_major,
                                                    without_residual_pass)
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import default_registry

from ..cuda_emu import emulate
from . import harness as hz
from .reference import reference_attention
from .test_cuda_decode import EMU_BUILD_DIR


def _plain_and_variant(monkeypatch, spec, config, transform):
    """The emulated kernel of ``spec`` as rendered, and with ``transform`` applied to its CUDA source."""
    scheme = default_registry().schemes[spec.scheme]
    plain = emulate.load(spec, scheme, EMU_BUILD_DIR, config=config)
    rendered = emulate.render

    def transformed(*args, **kwargs):
        sources = dict(rendered(*args, **kwargs))
        sources[".cu"] = transform(sources[".cu"])
        return sources

    monkeypatch.setattr(emulate, "render", transformed)
    return plain, emulate.load(spec, scheme, EMU_BUILD_DIR, config=config)


def test_split_major_grid_computes_the_same_attention(monkeypatch):
    """int8 at a group of 8 over ragged lengths (an empty sequence, page and split boundaries), 1, 3 and 7 splits:
    the (splits, heads, batch) grid's output against the float64 reference, and equal to the rendered grid's."""
    if emulate.toolchain() is None:
        pytest.skip("the CUDA emulation needs g++ and the CUDA headers")
    reg = default_registry()
    spec = KernelSpec(op="decode", scheme="int8", head_dim=64, num_kv_heads=2, gqa_group=8, page_size=16,
                      compute_dtype="float16", arch="sm_90a", backend="cuda")
    config = {"num_warps": 4, "depth": 2}
    plain, variant = _plain_and_variant(monkeypatch, spec, config, with_split_major)
    lengths = [517, 1, 0, 48, 33]
    cache = hz.make_cache("int8", 64, 2, 16, lengths, "float16", device="cpu", seed=11)
    q = hz.random_q(len(lengths), 16, 64, torch.float32, "cpu", seed=12).to(torch.float16)
    sm_scale = 1 / math.sqrt(64)
    ref = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], sm_scale=sm_scale)
    tol = hz.tolerance(reg.schemes["int8"], torch.float16)
    for splits in (1, 3, 7):
        outs = []
        for mod in (plain, variant):
            out = hz.poisoned_like(q)
            mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, sm_scale,
                       config=dict(config, num_splits=splits))
            assert torch.isfinite(out).all() and hz.rel_l2(out, ref) <= tol, splits
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), splits  # the same programs, scheduled in another order


def test_split_major_refuses_a_template_it_does_not_recognise():
    with pytest.raises(SystemExit, match="no longer"):
        with_split_major("__global__ void decode_kernel() {}")
    changed = with_split_major(f"{GRID_INDEX}\n{GRID_LAUNCH}\n")
    assert "split = blockIdx.x" in changed and "b = blockIdx.z" in changed and "dim3(a.num_splits, H, batch)" in changed


def test_no_residual_pass_matches_where_no_sequence_has_a_residual_tile(monkeypatch):
    """int4 without its residual tile loop: at whole pages (no residual tile) its output is the kernel's, bit for
    bit; with a partly filled tail page it leaves that page's tokens out, and the output moves."""
    if emulate.toolchain() is None:
        pytest.skip("the CUDA emulation needs g++ and the CUDA headers")
    spec = KernelSpec(op="decode", scheme="int4", head_dim=64, num_kv_heads=2, gqa_group=8, page_size=16,
                      compute_dtype="float16", arch="sm_90a", backend="cuda")
    config = {"num_warps": 4, "depth": 2, "num_splits": 3}
    plain, variant = _plain_and_variant(monkeypatch, spec, config, without_residual_pass)
    sm_scale = 1 / math.sqrt(64)
    for lengths, same in (([512, 16, 96], True), ([512, 23, 96], False)):
        cache = hz.make_cache("int4", 64, 2, 16, lengths, "float16", device="cpu", seed=5)
        q = hz.random_q(len(lengths), 16, 64, torch.float32, "cpu", seed=6).to(torch.float16)
        outs = []
        for mod in (plain, variant):
            out = hz.poisoned_like(q)
            mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, sm_scale,
                       config=config)
            assert torch.isfinite(out).all()
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) == same, lengths


def test_no_residual_pass_refuses_a_kernel_without_one():
    with pytest.raises(SystemExit, match="no longer"):
        without_residual_pass("__global__ void decode_kernel() {}")
    assert without_residual_pass(f"a\n{RESIDUAL_PASS}b\n") == "a\nb\n"


def test_page_record_refuses_a_kernel_it_does_not_recognise():
    with pytest.raises(SystemExit, match="no longer"):
        with_page_record("__global__ void decode_kernel() {}", 2816)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_page_record_variant_reads_the_same_pages_from_records(monkeypatch, scheme):
    """The page-record variant over pools laid out as records (as_records) computes bit for bit what the kernel
    computes over the scheme's own pools: int4's per-page and per-token metadata and its residual tail page, int8's
    per-token scales; ragged lengths, 2 splits. Its record is the scheme's page tensors back to back."""
    if emulate.toolchain() is None:
        pytest.skip("the CUDA emulation needs g++ and the CUDA headers")
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=64, num_kv_heads=2, gqa_group=8, page_size=16,
                      compute_dtype="float16", arch="sm_90a", backend="cuda")
    layout = record_layout(scheme, 64)
    config = {"num_warps": 4, "depth": 2, "num_splits": 2}
    plain, variant = _plain_and_variant(monkeypatch, spec, config,
                                        lambda src: with_page_record(src, sum(b for _, b in layout)))
    lengths = [300, 23, 1, 160]
    cache = hz.make_cache(scheme, 64, 2, 16, lengths, "float16", device="cpu", seed=7)
    records = as_records(cache.pools, [n for n, _ in layout])
    first = records[layout[0][0]]
    assert all(records[n].data_ptr() - first.data_ptr() == sum(b for _, b in layout[:i])
               for i, (n, _) in enumerate(layout))
    q = hz.random_q(len(lengths), 16, 64, torch.float32, "cpu", seed=8).to(torch.float16)
    outs = []
    for mod, pools in ((plain, cache.pools), (variant, records)):
        out = hz.poisoned_like(q)
        mod.launch(q, out, pools, cache.block_tables, cache.seq_lens, cache.num_compressed, 1 / math.sqrt(64),
                   config=config)
        assert torch.isfinite(out).all()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
