"""Compile one scheme's prefill kernels for sm_90 offline; print their register and spill use as JSON.

Per kernel: registers, spill bytes (cuobjdump's STACK and LOCAL), and per loop of its SASS (code order) its
instruction count, whether it is a masked tile's loop (it selects -inf into masked logits: FSEL) and how many
spill loads and stores (LDL/STL) it holds.

    python tests/kernels/sm90_build.py int8     (run by test_prefill_sm90_build.py in a fresh process)

A process of its own: Triton fixes interpreter or compiled mode when it is
imported, and the test session imports it for the interpreter (the shared
compile helper drops TRITON_INTERPRET before it imports Triton).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.experiments
import torch  # noqa: E402

from benchmarks.experiments.compile_sm90 import compile_prefill_kernel, sass_of  # noqa: E402
from benchmarks.experiments.sass_text import loop_bodies, opcode  # noqa: E402

# (kernel, constexprs, warps, stages): the tiles the GPU candidates use at D=128, GQA 8
KERNELS = (("_prefill_kernel", {"BLOCK_M": 16, "BLOCK_N": 32, "FRESH": True, "SKIP_STAGED": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 32, "FRESH": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 64, "FRESH": True}, 8, 2),
           ("_prefill_staged_kernel", {"BLOCK_M": 16, "BLOCK_N": 128, "FRESH": True}, 8, 3),  # the GPU default
           ("_stage_kernel", {"FRESH": True}, 4, 1))


def compile_sm90(fn, page_dtypes, constexprs, num_warps, num_stages):
    """(registers, spill bytes, loops) of ``fn`` compiled for sm_90 as the JIT compiles it on the GPU."""
    sass, regs, spills = sass_of(compile_prefill_kernel(fn, page_dtypes, constexprs, num_warps, num_stages))
    loops = []
    for body in loop_bodies(sass):
        ops = [opcode(ins) for ins in body]
        loops.append({"instructions": len(ops), "masked": "FSEL" in ops,
                      "spill_instructions": sum(op in ("STL", "LDL") for op in ops)})
    return regs, spills, loops


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
        regs, spills, loops = compile_sm90(getattr(mod, name), page_dtypes, consts, warps, stages)
        out.append({"kernel": name, "constexprs": consts, "num_warps": warps, "num_stages": stages,
                    "registers": regs, "spill_bytes": spills, "loops": loops})
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
