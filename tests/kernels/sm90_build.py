"""Compile one scheme's prefill kernels for sm_90 offline; print their register and spill use as JSON.

    python tests/kernels/sm90_build.py int8     (run by test_prefill_sm90_build.py in a fresh process)

A process of its own: Triton fixes interpreter or compiled mode when it is
imported, and the test session imports it for the interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TRITON_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int8: "*i8",
                torch.uint8: "*u8", torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv"}
COMPUTE_POINTERS = {"q_ptr", "out_ptr", "rk_ptr", "rv_ptr", "kn_ptr", "vn_ptr", "sk_ptr", "sv_ptr"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# (kernel, constexprs, warps, stages): the tiles the GPU candidates use at D=128, GQA 8
KERNELS = (("_prefill_kernel", {"BLOCK_M": 16, "BLOCK_N": 32, "FRESH": True, "SKIP_STAGED": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 32, "FRESH": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 64, "FRESH": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 128, "FRESH": True}, 8, 3),  # the GPU default
           ("_stage_kernel", {"FRESH": True}, 4, 1))


def compile_sm90(fn, page_dtypes, constexprs, num_warps, num_stages):
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
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage, re.S)
    return int(m.group(1)), int(m.group(2))


def main(scheme: str) -> None:
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    s = default_registry().schemes[scheme]
    spec = KernelSpec(op="prefill", scheme=scheme, head_dim=128, num_kv_heads=8, gqa_group=8, page_size=16,
                      compute_dtype="bfloat16", arch="sm_90")
    mod = load_kernel(spec, s)
    page_dtypes = {t.name: t.torch_dtype(torch.bfloat16) for t in s.page_tensors(128, 16)}
    out = []
    for name, consts, warps, stages in KERNELS:
        regs, local = compile_sm90(getattr(mod, name), page_dtypes, consts, warps, stages)
        out.append({"kernel": name, "constexprs": consts, "registers": regs, "spill_bytes": local})
    print(json.dumps(out))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: this compiles for the GPU")
    main(sys.argv[1])
