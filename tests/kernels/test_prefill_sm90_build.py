"""The prefill module's Triton kernels compile for sm_90 on a machine without a GPU, without spilling.

The interpreter runs the kernels' Python semantics only: a construct the
Triton compiler rejects (or a tile that spills registers) would pass every
CPU test and fail on the first GPU. Triton ships ptxas, so CI compiles the
in-place, staged and staging kernels here for sm_90 (D=128, GQA 8, bf16,
the tile sizes the GPU candidates use) and reads the cubin's register and
local-memory use. The staged attention kernel reads plain pages, so it must
not need more registers than the in-place kernel of the same tile.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from . import harness as hz

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without offline compilation
    pytest.skip("this Triton cannot compile offline", allow_module_level=True)

TRITON_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int8: "*i8",
                torch.uint8: "*u8", torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv"}
COMPUTE_POINTERS = {"q_ptr", "out_ptr", "rk_ptr", "rv_ptr", "kn_ptr", "vn_ptr", "sk_ptr", "sv_ptr"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile_sm90(fn, page_dtypes, constexprs, num_warps, num_stages, tmp_path):
    """(registers, local-memory bytes) of ``fn`` compiled for sm_90 with pointers 16-byte aligned."""
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in COMPUTE_POINTERS:
            sig[n] = TRITON_TYPES[torch.bfloat16]
        elif n.endswith("_ptr"):
            sig[n] = TRITON_TYPES[page_dtypes.get(n[:-4], torch.int32)]
        else:
            sig[n] = "fp32" if n == "sm_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = tmp_path / f"{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage, re.S)
    return int(m.group(1)), int(m.group(2))


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_prefill_kernels_build_for_sm90_without_spills(scheme, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the module must decorate real JIT functions
    case = hz.Case(scheme=scheme, head_dim=128, gqa=8, page_size=16, compute_dtype="bfloat16", num_kv_heads=8)
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec

    spec = KernelSpec(op="prefill", scheme=scheme, head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch="sm_90")
    mod = load_kernel(spec, case.scheme_obj)
    if getattr(mod, "INTERPRET", False):
        pytest.skip("the prefill module was imported under the interpreter")
    page_dtypes = {t.name: t.torch_dtype(torch.bfloat16) for t in case.scheme_obj.page_tensors(128, 16)}
    used = {}
    for name, extra, warps, stages in (("_prefill_kernel", {"BLOCK_N": 32}, 8, 2),
                                       ("_prefill_staged_kernel", {"BLOCK_N": 32}, 8, 2),
                                       ("_prefill_staged_kernel", {"BLOCK_N": 64}, 8, 2),
                                       ("_stage_kernel", {}, 4, 1)):
        consts = {"FRESH": True, **({"BLOCK_M": 16, **extra} if name != "_stage_kernel" else {})}
        regs, local = _compile_sm90(getattr(mod, name), page_dtypes, consts, warps, stages, tmp_path)
        assert local == 0, f"{scheme} {name} {consts}: {local} bytes of register spills"
        used[name, extra.get("BLOCK_N")] = regs
    assert used["_prefill_staged_kernel", 32] <= used["_prefill_kernel", 32]
