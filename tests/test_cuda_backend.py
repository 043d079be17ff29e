"""The CUDA backend: templates that build, escaping, packages (the decode numerics: kernels/test_cuda_decode.py).

CPU (CI): every CUDA template is rendered and built by nvcc for sm_90a (a
template that does not build fails here; the test skips only when nvcc is
absent), text in CUDA comments cannot break out, and packages compiled with
--backend cuda/auto hold and import what they should. The build cache's
tests are in test_cuda_build_cache.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from kvgen.codegen import cuda as cuda_backend
from kvgen.codegen.cppsource import comment
from kvgen.codegen.render import render_sources
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import default_registry
from kvgen.runtime import cuda_loader

NVCC = cuda_loader.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed: CUDA templates not built")


def _spec(scheme="bf16", head_dim=128, gqa=8, page=16, dtype="bfloat16", heads=8, **kw) -> KernelSpec:
    return KernelSpec(op="decode", scheme=scheme, head_dim=head_dim, num_kv_heads=heads, gqa_group=gqa,
                      page_size=page, compute_dtype=dtype, arch="sm_90", backend="cuda", **kw)


def _sources(spec: KernelSpec) -> dict[str, str]:
    reg = default_registry()
    return render_sources(spec, reg.schemes[spec.scheme], reg)


# Few, small builds (CI has 2 shared cores), yet every template, every CUDA macro file and every template
# branch: the Llama-3-70B shard shape; int8 with fp16 compute, three MMA column tiles of the group (G=20),
# pages smaller than a tile, a sliding window and a softcap; fp16 pages under bf16 compute at D=256 with one
# query head per KV head; KIVI with its residual pool; fp8 with a softcap.
BUILD_SPECS = [
    _spec(),
    _spec("int8", head_dim=64, gqa=20, page=8, dtype="float16", heads=2, sliding_window=40, softcap=30.0),
    _spec("fp16", head_dim=256, gqa=1, page=32, dtype="bfloat16", heads=4),
    _spec("int4", head_dim=64, gqa=4, page=32, dtype="float16", heads=2, sliding_window=40),  # KIVI + residual pool
    _spec("fp8", head_dim=128, gqa=4, page=16, dtype="bfloat16", heads=2, softcap=20.0),
    _spec("int2", head_dim=64, gqa=8, page=32, dtype="bfloat16", heads=2),  # 2-bit codes (2-byte value chunks)
]


def test_build_specs_cover_every_cuda_template_and_macro_file():
    templates = {p.name.removesuffix(".cu.j2") for p in (Path(__file__).parents[1] / "templates" / "cuda").glob("*.cu.j2")}
    assert templates == set(cuda_backend.OPS) == {s.op for s in BUILD_SPECS}
    reg = default_registry()
    macro_files = {cuda_backend.macro_template(reg.schemes[n]) for n in reg.schemes
                   if cuda_backend.reason_unsupported(_spec(n, head_dim=64), reg.schemes[n]) is None}
    assert macro_files == {cuda_backend.macro_template(reg.schemes[s.scheme]) for s in BUILD_SPECS}


@needs_nvcc
@pytest.mark.parametrize("spec", BUILD_SPECS, ids=lambda s: s.name)
def test_cuda_template_builds_for_sm_90a(spec, tmp_path):
    cu = _sources(spec)[".cu"]
    lib = cuda_loader.build(cu, "sm_90a", root=tmp_path)
    assert lib.parent == tmp_path / "cuda" and lib.name.endswith(f"-sm_90a-nvcc{cuda_loader.nvcc_version(NVCC)}.so")
    loaded = ctypes.CDLL(str(lib))  # loads without a GPU (the CUDA runtime is linked in statically)
    assert loaded.kvgen_abi_version() == cuda_backend.ABI_VERSION
    assert hasattr(loaded, "kvgen_decode")
    assert not [p for p in (tmp_path / "cuda").iterdir() if p != lib], "no temporary files are left behind"


def _ptx_function(ptx: str, name: str) -> str:
    """The body of the PTX entry whose mangled name contains ``name`` (the first, for a template's instances)."""
    entries = [m.start() for m in re.finditer(r"^\.entry ", ptx, re.M)]
    start = next(i for i in entries if name in ptx[i:ptx.find("(", i)])
    end = next((i for i in entries if i > start), len(ptx))
    return ptx[start:end]


@needs_nvcc
def test_pdl_signals_where_the_decode_design_says(tmp_path):
    """PDL order in the CUDA decode's PTX (the GPU test of PDL graphs runs only on the device): the decode kernel
    waits before anything else, and lets its dependents (a split launch's reduce kernel) launch only after it has
    issued every tile copy, before the warps' merge; the reduce kernel signals right after its wait, before its
    first load. Each dependent still waits for the whole grid in its own griddepcontrol.wait."""
    cu = tmp_path / "decode.cu"
    cu.write_text(_sources(_spec())[".cu"])
    ptx_path = tmp_path / "decode.ptx"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-ptx", "-o", str(ptx_path), str(cu)], check=True,
                   capture_output=True, timeout=600)
    ptx = ptx_path.read_text()
    dec = _ptx_function(ptx, "decode_kernel")
    wait, signal = dec.find("griddepcontrol.wait"), dec.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < dec.find("cp.async") and dec.count("griddepcontrol.launch_dependents") == 1
    assert dec.rfind("cp.async.cg.shared.global") < signal < dec.find("cp.async.wait_group 0")
    red = _ptx_function(ptx, "reduce_kernel")
    assert 0 <= red.find("griddepcontrol.wait") < red.find("griddepcontrol.launch_dependents") < red.find("ld.global")


def _ptxas_decode_instances(spec: KernelSpec, tmp_path: Path) -> dict[tuple[int, int], dict[str, int]]:
    """ptxas's report (``-Xptxas -v``) of every ``decode_kernel<NW, DEPTH>`` instance of ``spec``, built for sm_90a."""
    from benchmarks.experiments.cuda_sass import NVCC_FLAGS, ptxas_report

    src = tmp_path / f"{spec.name}.cu"
    src.write_text(_sources(spec)[".cu"])
    built = subprocess.run([NVCC, *NVCC_FLAGS, "-o", str(tmp_path / f"{spec.name}.cubin"), str(src)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    report = ptxas_report(built.stderr)
    assert report, "no decode_kernel instance in ptxas's report"
    return report


@needs_nvcc
def test_decode_register_cap_holds_where_measured_and_spares_wider_tiles(tmp_path):
    """The decode kernel is held to 128 registers (16 warps an SM) at D <= 128 with groups of at most 8, where the
    lazy rescale's branch otherwise took int4 past 150 (decode.cu.j2, lazy rescale); wider heads or groups keep
    what ptxas takes: held to 128, int8 at a group of 16 spilled about 190 bytes a thread."""
    capped = _ptxas_decode_instances(_spec("int4", head_dim=128, gqa=8, heads=2), tmp_path)
    assert all(r["regs"] <= 128 for r in capped.values()), capped
    wide = _ptxas_decode_instances(_spec("int8", head_dim=128, gqa=16, heads=2), tmp_path)
    assert all(r.get("spill_st", 0) == 0 for r in wide.values()), wide
    assert max(r["regs"] for r in wide.values()) > 128, wide


@needs_nvcc
def test_fp8_reader_builds_before_sm_89(tmp_path):
    """The fp8 reader converts codes with cvt.rn.f16x2.e4m3x2 from sm_89 and by bit arithmetic before (the CUDA
    decode serves sm_80+): the older path must build too."""
    cu = _sources(_spec("fp8", head_dim=128, gqa=8, page=16, heads=2))[".cu"]
    lib = cuda_loader.build(cu, "sm_80", root=tmp_path)
    assert ctypes.CDLL(str(lib)).kvgen_abi_version() == cuda_backend.ABI_VERSION
    assert "KVGEN_FP8_CVT" in cu and "cvt.rn.f16x2.e4m3x2" in cu


def test_unsupported_specs_name_a_reason():
    reg = default_registry()
    cases = {
        "prefill": (dataclasses.replace(_spec(), op="prefill"), "bf16"),
        "float32": (_spec("fp32", dtype="float32"), "fp32"),
        "head_dim": (_spec(head_dim=72), "bf16"),
        "16-bit pages needs": (_spec(head_dim=80), "bf16"),  # a multiple of 16 the readers' geometry cannot tile
        "int8 reader needs": (_spec("int8", head_dim=96), "int8"),
        "page size": (_spec(page=24), "bf16"),
        "multiple of 16": (_spec("int4", page=8), "int4"),  # residual schemes need whole tiles per page
        "64, 128 or 256": (_spec("int2", head_dim=32), "int2"),
        "KIVI reader needs": (_spec("int4", head_dim=96), "int4"),
        "CUDA macros": (_spec("nuq4"), "nuq4"),
        "fp8 reader needs": (_spec("fp8", head_dim=80), "fp8"),
        "sm_80": (dataclasses.replace(_spec(), arch="sm_75"), "bf16"),
    }
    for word, (spec, scheme) in cases.items():
        if scheme not in reg.schemes:
            continue  # a plugin this install lacks
        reason = cuda_backend.reason_unsupported(spec, reg.schemes[scheme])
        assert reason and word in reason, (word, reason)
    assert cuda_backend.reason_unsupported(_spec("int8"), reg.schemes["int8"]) is None
    assert cuda_backend.reason_unsupported(_spec("int4"), reg.schemes["int4"]) is None
    assert cuda_backend.reason_unsupported(_spec("int2"), reg.schemes["int2"]) is None
    assert cuda_backend.reason_unsupported(_spec("int2", head_dim=64), reg.schemes["int2"]) is None
    with pytest.raises(ValueError, match="cannot use the CUDA backend"):
        _sources(_spec(head_dim=72))


def test_kernel_spec_backend_is_validated_and_hashed():
    with pytest.raises(ValueError, match="backend"):
        KernelSpec(op="decode", scheme="bf16", head_dim=64, num_kv_heads=1, gqa_group=1, page_size=16,
                   compute_dtype="bfloat16", arch="sm_90", backend="cuda; rm")
    assert _spec().hash != dataclasses.replace(_spec(), backend="triton").hash


# --------------------------------------------------------------------------- escaping


@pytest.mark.parametrize("text", ["plain", "new\nline", "ends in backslash \\", "*/ #include <x>", "ünïcode\r\x00"])
def test_cuda_comment_is_one_safe_line(text):
    line = comment(text)
    assert line.startswith("// ") and "\n" not in line and "\r" not in line and line.isascii()
    assert not line.endswith("\\")  # a trailing backslash would splice the next line into the comment


def test_hostile_scheme_params_stay_in_the_header_comment():
    hostile = '"x\\\n#error injected\\'
    spec = _spec("int8", scheme_params=(("codebook", json.dumps(hostile)),))
    cu = _sources(spec)[".cu"]
    head = cu.splitlines()[:3]
    assert all(line.startswith("// ") and not line.endswith("\\") for line in head)
    assert "#error" not in "\n".join(cu.splitlines()[3:])
    py = _sources(spec)[".py"]
    compile(py, "decode.py", "exec")  # the Python side parses


# --------------------------------------------------------------------------- packages


def _plan(scheme="bf16", tmp_path=None):
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.targets import resolve_target

    model = dataclasses.replace(resolve_model("llama-3-8b"), name=f"cudatest-{scheme}", num_layers=1)
    return make_plan(model, resolve_target("h200"), Workload(context=4096, concurrency=4, page_size=16),
                     default_registry().schemes, kv=scheme)


def test_package_with_cuda_backend_carries_source_and_imports_without_building(tmp_path, monkeypatch):
    from kvgen.codegen.package import compile_plan
    from kvgen.integrations.transformers import import_package

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    plan = _plan("int8")
    res = compile_plan(plan, tmp_path / "pkg", backend="cuda", build=False)
    assert {"kernels/decode.py", "kernels/decode.cu", "kernels/prefill.py"} <= set(res.files)
    assert not any(p.startswith("kernels/prefill") and p.endswith(".cu") for p in res.files)
    assert any(n.startswith("prefill stays Triton") for n in res.notes)
    meta = json.loads((res.out_dir / "plan.json").read_text())
    assert meta["backend"] == "cuda" and meta["kernels"]["decode"]["backend"] == "cuda"
    assert meta["kernels"]["prefill"]["backend"] == "triton" and "no CUDA template" in meta["kernels"]["prefill"]["no_cuda"]
    manifest = json.loads((res.out_dir / "manifest.json").read_text())
    assert "kernels/decode.cu" in manifest["files"]
    pkg = import_package(res.out_dir)
    mod = pkg.KERNELS["decode"]
    assert mod.BACKEND == "cuda" and mod.SOURCE.read_text() == res.files["kernels/decode.cu"]
    assert mod.__name__.endswith(".kernels.decode") and mod._cuda.__name__.endswith(".runtime.cuda_loader")
    assert not (tmp_path / "cache" / "cuda").exists()  # importing built nothing
    assert compile_plan(plan, tmp_path / "pkg", backend="cuda", build=False).unchanged  # deterministic


def test_auto_backend_keeps_triton_default_and_adds_cuda_variant(tmp_path):
    from kvgen.codegen.package import compile_plan
    from kvgen.integrations.transformers import import_package

    res = compile_plan(_plan("bf16"), tmp_path / "pkg", backend="auto", build=False)
    assert {"kernels/decode.py", "kernels/decode_cuda.py", "kernels/decode_cuda.cu"} <= set(res.files)
    pkg = import_package(res.out_dir)
    assert pkg.BACKEND == "auto" and not hasattr(pkg.KERNELS["decode"], "BACKEND")  # Triton module
    assert pkg.KERNEL_VARIANTS["decode"]["cuda"].BACKEND == "cuda"
    assert set(pkg.KERNEL_VARIANTS["prefill"]) == {"triton"}
    triton_only = compile_plan(_plan("bf16"), tmp_path / "pkg2", build=False)
    assert not any(p.endswith(".cu") for p in triton_only.files)


def test_schemes_without_cuda_macros_stay_triton(tmp_path):
    from kvgen.codegen.package import compile_plan

    if "nuq4" not in default_registry().schemes:
        pytest.skip("the kvgen-nuq plugin (a scheme without CUDA macros) is not installed")
    res = compile_plan(_plan("nuq4"), tmp_path / "pkg", backend="cuda", build=False)
    assert not any(p.endswith(".cu") for p in res.files)
    assert any("decode stays Triton" in n and "no CUDA macros" in n for n in res.notes)


def test_unknown_backend_is_a_one_line_error(tmp_path):
    from kvgen.codegen.package import BackendError, compile_plan
    from kvgen.errors import KvgenError

    with pytest.raises(BackendError, match="triton, cuda, auto") as info:
        compile_plan(_plan("bf16"), tmp_path / "pkg", backend="opencl")
    assert isinstance(info.value, KvgenError) and not (tmp_path / "pkg").exists()


def test_16_bit_pages_past_d64_are_built_and_tuned_for_two_stages_only():
    """Three 8 KB stages of 16-bit pages (D=128) a warp would not fit an A100's shared memory at 8 warps: their
    library has 2 stages only, so the tuner never times a config that cannot launch; at D=64 (4 KB stages) and
    for 8- and 4-bit pages every depth is built, and the default config is one the library has."""
    from kvgen.codegen.loader import load_kernel

    for scheme, d, depths in (("bf16", 128, [2]), ("fp16", 256, [2]), ("bf16", 64, [2, 3, 4]),
                              ("int8", 64, [2, 3, 4]), ("int4", 64, [2, 3, 4]), ("int8", 128, [2, 3, 4])):
        spec = dataclasses.replace(_spec(scheme, head_dim=d, gqa=2, heads=1), arch="cpu")
        mod = load_kernel(spec, default_registry().schemes[scheme])
        assert list(mod.DEPTHS) == depths
        assert sorted({c["depth"] for c in mod.candidates(4, 1024)}) == depths
        assert mod.default_config(4, 1024)["depth"] in depths
        src = _sources(spec)[".cu"]
        assert [d for d in (1, 2, 3, 4) if f"launch_decode<4, {d}>" in src] == depths


def test_cuda_decode_refuses_cpu_tensors_with_a_clear_error():
    import torch

    from kvgen.codegen.loader import load_kernel

    spec = dataclasses.replace(_spec(head_dim=64, gqa=2, heads=1), arch="cpu")
    mod = load_kernel(spec, default_registry().schemes["bf16"])
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    pools = {"k": torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16), "v": torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16)}
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    with pytest.raises(cuda_loader.CudaBuildError, match="CUDA device"):
        mod.launch(q, torch.empty_like(q), pools, i32(1, 1), i32(1), i32(1), 0.125)
    # pages are copied with 16-byte cp.async: a pool starting 2 bytes into its storage is refused, not read
    odd = torch.zeros(2 * 16 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 1, 16, 64)
    assert odd.is_contiguous() and odd.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        mod.launch(q, torch.empty_like(q), dict(pools, k=odd), i32(1, 1), i32(1), i32(1), 0.125)
