"""CUDA decode numerics, on two runners.

Every CUDA reader against the scheme's float64 reference (relative L2 within
the scheme's tolerance) with poisoned outputs and pools: page-boundary
lengths, ragged batches, splits, warps, pipeline depths, sliding windows,
softcaps and the readers' numerics contracts.

- ``emulated`` (CPU, CI): the kernels rendered from the same templates with
  the host platform of ``tests/cuda_emu`` in place of
  ``templates/cuda/platform.j2`` (one fiber per CUDA thread; mma,
  movmatrix, shuffles, cp.async and shared-memory banks modelled in C++),
  built by g++ and run on CPU tensors. Skips where g++ or the CUDA
  toolkit's headers are missing. A few long cases are shortened there
  (``long_len``), and the bank-conflict and fiber tests are the
  emulation's alone.
- ``gpu`` (``pytest -m gpu`` on the device, ``KVGEN_TEST_DEVICE=cuda``): the
  real kernels, built by nvcc for the device.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

from kvgen.codegen.spec import KernelSpec
from kvgen.registry import default_registry

from ..cuda_emu import emulate
from . import harness as hz
from .reference import reference_attention


class Runner:
    """Loads and runs CUDA decode kernels on the device (``gpu``) or on the CPU through the emulation."""

    def __init__(self, kind: str):
        self.kind = kind
        self.gpu = kind == "gpu"
        if self.gpu:
            hz.require_cuda()
        elif emulate.toolchain() is None:
            pytest.skip("the CUDA emulation needs g++ and the CUDA toolkit's headers (nvcc's install)")
        self.device = "cuda" if self.gpu else "cpu"
        self.arch = hz.arch_name("cuda") if self.gpu else "sm_90a"

    def load(self, spec: KernelSpec, config: dict | None = None, every_config=False, defines: tuple[str, ...] = ()):
        """The kernel of ``spec``; the emulation builds ``config``'s instance alone unless ``every_config``."""
        scheme = default_registry().schemes[spec.scheme]
        if self.gpu:
            assert not defines, "defines are for the emulation"
            from kvgen.codegen.loader import load_kernel

            return load_kernel(spec, scheme)
        return emulate.load(spec, scheme, EMU_BUILD_DIR, config=config, every_config=every_config, defines=defines)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def long_len(self, n: int, short: int) -> int:
        """A long sequence's length: ``n`` on the GPU, ``short`` in the emulation (a few thousand warp-tiles a
        second on one core)."""
        return n if self.gpu else short


# Emulation libraries are keyed by their source, the emulation headers and the compiler: one folder for every
# pytest worker and run, so each is built once.
EMU_BUILD_DIR = Path(tempfile.gettempdir()) / f"kvgen-cuda-emu-{os.getuid()}"


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def runner(request) -> Runner:
    return Runner(request.param)


CASES = [  # scheme, head_dim, gqa, page, compute dtype, kv heads
    ("bf16", 128, 8, 16, "bfloat16", 8),
    ("fp16", 128, 8, 16, "float16", 8),
    ("int8", 128, 8, 16, "bfloat16", 8),
    ("int8", 64, 8, 16, "float16", 4),
    ("fp8", 128, 8, 16, "bfloat16", 8),
    ("fp8", 64, 4, 8, "float16", 2),
    ("bf16", 64, 4, 32, "bfloat16", 2),
    ("int8", 128, 4, 8, "bfloat16", 2),
    ("int8", 128, 16, 16, "float16", 2),  # two MMA column tiles of the group, each with its key-bias start
    ("fp16", 256, 1, 16, "float16", 2),
    ("bf16", 128, 20, 16, "bfloat16", 1),
    ("int4", 128, 8, 16, "bfloat16", 8),   # KIVI: compressed pages, then the residual tail page
    ("int4", 64, 4, 32, "float16", 2),
    ("int4", 256, 2, 16, "bfloat16", 2),
    ("int2", 128, 8, 16, "bfloat16", 8),   # 2-bit codes; lengths past 128 tokens reach the compressed pages
    ("int2", 128, 4, 32, "float16", 2),
    ("int2", 64, 4, 16, "float16", 4),     # 2-byte value chunks: the low half of a word
    ("int2", 256, 2, 16, "bfloat16", 2),
]


def decode(runner: Runner, scheme, head_dim, gqa, page, dtype, heads, lengths, *, config=None, window=0,
           softcap=0.0, q_scale=1.0, q_shift=0.0, seed=0, defines=(), every_config=False):
    """One decode of a random poisoned cache against the float64 reference; returns (out, ref, cache, q, sm_scale).
    ``every_config``: the emulation builds every instance (for tests that run several configs of one spec)."""
    reg = default_registry()
    if scheme not in reg.schemes:
        pytest.skip(f"scheme {scheme} not installed")
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=head_dim, num_kv_heads=heads, gqa_group=gqa,
                      page_size=page, compute_dtype=dtype, arch=runner.arch, backend="cuda",
                      sliding_window=window, softcap=softcap)
    mod = runner.load(spec, config, every_config, defines)
    cache = hz.make_cache(scheme, head_dim, heads, page, lengths, dtype, device=runner.device, seed=seed)
    q = hz.random_q(len(lengths), heads * gqa, head_dim, torch.float32, "cpu", seed=seed + 1) * q_scale + q_shift
    q = q.to(getattr(torch, dtype)).to(runner.device)
    out = hz.poisoned_like(q)
    sm_scale = 1.0 / math.sqrt(head_dim)
    mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, sm_scale, config=config)
    runner.sync()
    ref = reference_attention(q, cache.ks, cache.vs, [n - 1 for n in lengths], window=window, softcap=softcap,
                              sm_scale=sm_scale)
    err = hz.rel_l2(out, ref)
    tol = hz.tolerance(reg.schemes[scheme], getattr(torch, dtype))
    assert err <= tol, f"{spec.name} lengths {lengths} config {config}: rel L2 {err:.3g} > {tol:.3g}"
    assert torch.isfinite(out).all()
    return out, ref, cache, q, sm_scale


def boundary_lengths(page):
    return [1, page - 1, page, page + 1, 16, 17, 3 * page + 1, 100 * page + 7]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_decode_page_boundaries_and_ragged(runner, case):
    scheme, d, g, p, dtype, h = case
    decode(runner, scheme, d, g, p, dtype, h, boundary_lengths(p))


def _registered_cases():
    """The real-size geometry (64/8 heads' group of 8, D=128, page 16, or the scheme's own) of every registered
    scheme whose CUDA macros can render it, third-party plugins' included (docs/plugin-guide.md, CUDA macros)."""
    from kvgen.codegen import cuda as cuda_backend
    from kvgen.codegen.render import environment, layouts

    reg = default_registry()
    params = []
    for scheme in hz.all_schemes():
        case = hz.gpu_case(scheme.name)
        page_dtype = scheme.page_tensors(case.head_dim, case.page_size)[0].dtype
        dtype = page_dtype if page_dtype in ("float16", "bfloat16") else "float16"
        spec = KernelSpec(op="decode", scheme=scheme.name, head_dim=case.head_dim, num_kv_heads=2, gqa_group=8,
                          page_size=case.page_size, compute_dtype=dtype, arch="sm_90a", backend="cuda")
        L, _ = layouts(spec, scheme)
        if cuda_backend.unsupported(spec, scheme, L, environment(reg)) is None:
            params.append(pytest.param((scheme.name, case.head_dim, 8, case.page_size, dtype, 2), id=scheme.name))
    return params


@pytest.mark.parametrize("case", _registered_cases())
def test_cuda_decode_every_registered_scheme(runner, case):
    """Whatever registers CUDA macros is checked here without a test of its own: page boundaries and a ragged batch
    past the scheme's residual window."""
    scheme, d, g, p, dtype, h = case
    ragged = hz.lengths_for("ragged", hz.get_scheme(scheme), p)
    decode(runner, scheme, d, g, p, dtype, h, sorted(set(boundary_lengths(p) + ragged)))


def _split_lengths(runner):
    # per-warp tile counts below, at and past every depth, so that a pipeline ends on any stage
    return [runner.long_len(4099, 1029), 1, 0, 640, 33, 16 * 4 * 3 + 5]


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8", "int4", "int2"])
@pytest.mark.parametrize("splits,warps,depth", [(1, 4, 2), (1, 8, 3), (3, 4, 4), (16, 8, 2), (128, 4, 4), (2, 8, 4)])
def test_cuda_decode_splits_warps_and_depth(runner, scheme, splits, warps, depth):
    depth = 2 if scheme == "bf16" else depth  # 16-bit pages past D=64 are built for 2 stages only
    decode(runner, scheme, 128, 8, 16, "bfloat16", 4, _split_lengths(runner),
           config={"num_splits": splits, "num_warps": warps, "depth": depth}, every_config=True)


@pytest.mark.parametrize("scheme", ["bf16", "fp16"])
@pytest.mark.parametrize("splits,warps,depth", [(1, 4, 3), (3, 8, 4), (16, 4, 4)])
def test_cuda_decode_16bit_pages_deeper_rings_at_d64(runner, scheme, splits, warps, depth):
    # 16-bit pages at D=64 are built for 3 and 4 stages too (depths_for); pipelines ending on every stage
    dtype = "bfloat16" if scheme == "bf16" else "float16"
    decode(runner, scheme, 64, 8, 16, dtype, 4, _split_lengths(runner),
           config={"num_splits": splits, "num_warps": warps, "depth": depth}, every_config=True)


@pytest.mark.parametrize("scheme", ["int4", "int2"])
@pytest.mark.parametrize("splits,warps,depth", [(1, 8, 4), (3, 4, 3), (16, 8, 2)])
def test_cuda_decode_kivi_at_d64_splits_warps_and_depth(runner, scheme, splits, warps, depth):
    # D=64: a lane's value chunk is 4 bytes (int4) or the low 2 bytes of a word (int2, since d8c4ea5)
    decode(runner, scheme, 64, 8, 16, "float16", 4, _split_lengths(runner),
           config={"num_splits": splits, "num_warps": warps, "depth": depth}, every_config=True)
    if splits == 3:  # a window reaching the compressed pages, with a softcap
        decode(runner, scheme, 64, 4, 16, "bfloat16", 2, [7, 300, 1025], window=200, softcap=30.0, q_scale=3.0,
               config={"num_splits": splits, "num_warps": warps, "depth": depth})


@pytest.mark.parametrize("scheme", ["fp16", "int8", "fp8", "int4", "int2"])
def test_cuda_decode_window_and_softcap(runner, scheme):
    p = 16
    # int2 keeps its last 128 tokens exact: windows past them reach the 2-bit pages
    windows = ((200, 0.0), (0, 20.0), (300, 30.0)) if scheme == "int2" else ((40, 0.0), (0, 20.0), (100, 30.0))
    # int8 and fp8 also at page 8: tiles span pages there, and each row's page is looked up on its own
    pages = (8, p) if scheme in ("int8", "fp8") else (p,)
    for (window, softcap), page in itertools.product(windows, pages):
        decode(runner, scheme, 128 if scheme == "int2" else 64, 4, page, "float16", 2, [7, 41, 300, 1025],
               window=window, softcap=softcap, q_scale=3.0, config={"num_splits": 4, "num_warps": 4, "depth": 2})


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_cuda_decode_biased_key_operands_cancel(runner, scheme):
    """int8 hands the score MMAs 1152 + code and starts every score at -1152 * sum(q) (decode.cu.j2, key operand
    bias). q with a large common offset makes that start far larger than any score: the float16-compute error must
    stay within the scheme's 2e-3 all the same. fp8 (no bias) runs the same inputs as the control."""
    decode(runner, scheme, 128, 8, 16, "float16", 2, [runner.long_len(5000, 1500), 17, 1, 1000], q_scale=2.0,
           q_shift=3.0)
    decode(runner, scheme, 64, 4, 8, "float16", 2, [runner.long_len(4099, 1029), 33], q_scale=0.5, q_shift=-2.0,
           seed=3)


def test_cuda_decode_fp8_reader_before_sm_89(runner):
    """The fp8 reader's path for devices without the e4m3 conversion (bit arithmetic on whole words, codes paired
    (0, 2) and (1, 3)): the emulation builds it by defining KVGEN_FP8_CVT=0, which on a GPU only an sm_80 build
    does."""
    if runner.gpu:
        pytest.skip("an sm_90 device takes the conversion path; tests/test_cuda_backend.py builds this one for sm_80")
    for d, g, p, dtype in ((128, 8, 16, "bfloat16"), (64, 4, 8, "float16")):
        decode(runner, "fp8", d, g, p, dtype, 2, boundary_lengths(p), defines=("KVGEN_FP8_CVT=0",))
        decode(runner, "fp8", d, g, p, dtype, 2, [1029, 5], q_scale=3.0, defines=("KVGEN_FP8_CVT=0",),
               config={"num_splits": 3, "num_warps": 8, "depth": 3})


@pytest.mark.parametrize("scheme", ["bf16", "fp16", "int8", "fp8", "int4", "int2"])
def test_cuda_decode_peaked_attention_with_large_q(runner, scheme):
    """q x 4 (fp16) and x 2.5 (bf16): scores several log2 units apart and a row max that keeps rising over 4K
    tokens in one split (for KIVI, q at the top of its usual range in the folded score operands, decode.cu.j2)."""
    for q_scale, dtype in ((4.0, "float16"), (2.5, "bfloat16")):
        if {"bf16": "bfloat16", "fp16": "float16"}.get(scheme, dtype) != dtype:
            continue  # 16-bit pages compute in their own dtype
        decode(runner, scheme, 128, 8, 16, dtype, 2, [runner.long_len(4099, 2051), 300, 17], q_scale=q_scale,
               config={"num_splits": 1, "num_warps": 4, "depth": 2})


@pytest.mark.parametrize("scheme", ["int4", "int2"])
def test_cuda_decode_kivi_finite_at_capped_key_scales_and_large_q(runner, scheme):
    """Keys whose page scales reach the cap (K/V x 2e4) against q x 500 (|q * sm_scale * log2(e)| up to ~250):
    finite K/V must give a finite output (the Numerics contract). A fixed factor of 2^-4 for q made the fold's fp16
    products q' * scale reach 1e5 here (checked on the CPU with the same cache): NaN scores. q's power-of-two
    factor per warp bounds them by 65504."""
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=128, num_kv_heads=2, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch=runner.arch, backend="cuda")
    mod = runner.load(spec)
    cache = hz.make_cache(scheme, 128, 2, 16, [300, 200], "bfloat16", device=runner.device, seed=0, scale=2e4)
    q = (hz.random_q(2, 16, 128, torch.float32, "cpu", seed=1) * 500).to(torch.bfloat16).to(runner.device)
    out = hz.poisoned_like(q)
    mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, 1 / math.sqrt(128))
    runner.sync()
    assert torch.isfinite(out).all(), "finite K/V gave a non-finite decode output"


@pytest.mark.parametrize("scheme", ["bf16", "int8", "fp8", "int4"])
def test_cuda_decode_diffuse_attention_over_long_rows(runner, scheme):
    """Nearly uniform attention over 16K tokens in one split (4K in the emulation): each warp accumulates a
    quarter of them into an output far smaller than any one value, where accumulation error shows (a value-side
    operand bias failed this way)."""
    decode(runner, scheme, 128, 8, 16, "float16", 2, [runner.long_len(16384, 4096), 5], q_scale=0.05,
           config={"num_splits": 1, "num_warps": 4, "depth": 2})


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4", "int2"])
def test_gpu_cuda_decode_real_size_matches_triton(scheme):
    """The Llama-3-70B shard shape at long contexts: CUDA and Triton agree on one cache, both near the reference
    (GPU only: the Triton interpreter would take hours at this size)."""
    from kvgen.codegen.loader import load_kernel

    runner = Runner("gpu")
    out_c, ref, cache, q, sm_scale = decode(runner, scheme, 128, 8, 16, "bfloat16", 8, [4096] * 6 + [8191, 1])
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch=hz.arch_name("cuda"))
    out_t = hz.poisoned_like(q)
    load_kernel(spec, default_registry().schemes[scheme]).launch(
        q, out_t, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, sm_scale)
    torch.cuda.synchronize()
    assert hz.rel_l2(out_c, out_t) < 1e-2, "CUDA and Triton decode disagree"
    assert hz.rel_l2(out_t, ref) < 2e-2


def test_cuda_config_too_large_for_shared_memory_fails_alone(runner):
    """16-bit pages at D=256, 8 warps x 2 stages need 256 KB of shared memory, more than any GPU has (the emulation
    holds a block to an H100's 227 KB): that launch fails with a CUDA error (the tuner skips such a candidate), and
    the next launch of the same library runs and is right instead of reporting the old error."""
    from kvgen.runtime.cuda_loader import CudaBuildError

    with pytest.raises(CudaBuildError if runner.gpu else RuntimeError, match="kernel launch failed"):
        decode(runner, "fp16", 256, 2, 16, "float16", 2, [33, 300],
               config={"num_splits": 1, "num_warps": 8, "depth": 2})
    decode(runner, "fp16", 256, 2, 16, "float16", 2, [33, 300], config={"num_splits": 1, "num_warps": 4, "depth": 2})


def _random_case(seed: int):
    """A supported geometry drawn from ``seed``: every scheme, head dims 32-256, groups of 1-20 (several MMA column
    tiles past 8), pages of 1-64 tokens, windows and softcaps, ragged lengths with empty sequences, any built
    config whose shared memory fits an H100."""
    import random

    from kvgen.codegen import cuda as cuda_backend
    from kvgen.codegen.render import environment, layouts

    rng = random.Random(seed)
    reg = default_registry()
    while True:
        scheme = rng.choice(["bf16", "fp16", "int8", "fp8", "int4", "int2"])
        d, g = rng.choice([32, 64, 128, 256]), rng.choice([1, 2, 3, 5, 6, 8, 12, 20])
        page = rng.choice([1, 4, 8, 16, 32, 64])
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(scheme, rng.choice(["bfloat16", "float16"]))
        spec = KernelSpec(op="decode", scheme=scheme, head_dim=d, num_kv_heads=rng.choice([1, 3]), gqa_group=g,
                          page_size=page, compute_dtype=dtype, arch="sm_90a", backend="cuda",
                          sliding_window=rng.choice([0, 0, 1, 16, 33, 200]), softcap=rng.choice([0.0, 0.0, 30.0]))
        L, _ = layouts(spec, reg.schemes[scheme])
        if cuda_backend.unsupported(spec, reg.schemes[scheme], L, environment(reg)):
            continue
        config = {"num_splits": rng.choice([1, 2, 5, 16]), "num_warps": rng.choice(cuda_backend.WARPS),
                  "depth": rng.choice(cuda_backend.depths_for(L))}
        if d == 256 and config["num_warps"] == 8:
            continue  # 8 warps of D=256 stages can exceed a block's shared memory (the too-large test covers it)
        lengths = [rng.choice([0, 1, 15, 16, 17, 63, 64, 65, 129, 130, 257, 1025]) for _ in range(rng.randint(1, 4))]
        return spec, config, lengths if any(lengths) else lengths + [7]


@pytest.mark.parametrize("seed", range(12))
def test_cuda_decode_random_geometries(runner, seed):
    spec, config, lengths = _random_case(seed)
    decode(runner, spec.scheme, spec.head_dim, spec.gqa_group, spec.page_size, spec.compute_dtype, spec.num_kv_heads,
           lengths, config=config, window=spec.sliding_window, softcap=spec.softcap, q_scale=2.0, seed=seed)


# Shared-memory reads whose bank conflicts are known and kept (decode_stage.j2, Stage::at and MetaView): the 4-byte
# value reads of 32-byte rows (int4 at D=64, int2 at D=128) conflict 2-way, and int2's residual tiles (its last 128
# tokens, bf16 rows read in 32-byte value chunks) add a little more; KIVI's per-page key metadata at D >= 128 is read
# 2-way conflicted (storing it conflict-free spilled registers and ran slower on an H100). Every other read must take
# one wavefront a pass; the bounds of the kept cases are today's counts, so that a read that gets worse fails.
BANK_CASES = [  # scheme, head_dim, compute dtype, the most wavefronts a read may take on average
    ("bf16", 64, "bfloat16", 1.0), ("bf16", 128, "bfloat16", 1.0), ("fp16", 256, "float16", 1.0),
    ("int8", 64, "float16", 1.0), ("int8", 128, "bfloat16", 1.0), ("fp8", 128, "bfloat16", 1.0),
    ("int2", 64, "float16", 1.0), ("int4", 64, "float16", 1.13), ("int4", 128, "bfloat16", 1.58),
    ("int4", 256, "bfloat16", 1.62), ("int2", 128, "bfloat16", 1.72),
]


def bank_stats(scheme: str, head_dim: int, dtype: str, tokens: int = 1216) -> dict[str, dict[str, int]]:
    """The emulation's shared-memory read counts (EmulatedDecode.lds_stats) over one decode of ``tokens`` tokens:
    one KV head, a group of 8, page 16, 4 warps, 2 stages, one split (benchmarks/experiments/cuda_emu_banks)."""
    runner = Runner("emulated")
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=head_dim, num_kv_heads=1, gqa_group=8, page_size=16,
                      compute_dtype=dtype, arch=runner.arch, backend="cuda")
    config = {"num_splits": 1, "num_warps": 4, "depth": 2}
    mod = runner.load(spec, config)
    cache = hz.make_cache(scheme, head_dim, 1, 16, [tokens], dtype, device="cpu", seed=0)
    q = hz.random_q(1, 8, head_dim, torch.float32, "cpu").to(getattr(torch, dtype))
    mod.lds_stats(reset=True)
    mod.launch(q, hz.poisoned_like(q), cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed,
               1 / math.sqrt(head_dim), config=config)
    return mod.lds_stats()


@pytest.mark.parametrize("scheme,head_dim,dtype,most", BANK_CASES, ids=lambda v: str(v))
def test_cuda_decode_shared_memory_reads_bank_conflicts(scheme, head_dim, dtype, most):
    """The stage layouts' claim (decode_stage.j2): fragment and metadata reads free of bank conflicts, counted by the
    emulation's bank model over a whole decode (every lds_words of every warp; no GPU counter is read)."""
    stats = bank_stats(scheme, head_dim, dtype)
    total = stats["all"]
    assert total["reads"] >= 1216 // 16 * 4, "the decode read less of its stages than its tiles hold"
    ratio = total["wavefronts"] / total["ideal"]
    assert ratio <= most, f"{scheme} D={head_dim}: {ratio:.3f} wavefronts a pass ({stats})"

def test_cuda_decode_emulation_on_the_portable_fiber_switch():
    """The emulation's fibers switch by hand-written assembly on x86-64 and by swapcontext elsewhere: the fallback,
    forced here, runs a decode as well (splits, a window, KIVI's residual pages)."""
    runner = Runner("emulated")
    decode(runner, "int4", 128, 8, 16, "bfloat16", 2, [1, 17, 300], window=100, defines=("KVGEN_EMU_UCONTEXT=1",),
           config={"num_splits": 3, "num_warps": 4, "depth": 2})
