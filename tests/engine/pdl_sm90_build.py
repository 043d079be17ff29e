"""Compile the engine's fused Triton kernels for sm_90 offline, with and without PDL; print where their PTX
waits for the previous kernel and where it lets the next one launch, as JSON.

    python tests/engine/pdl_sm90_build.py     (run by test_pdl_sm90_build.py in a fresh process)

A process of its own: Triton fixes interpreter or compiled mode when it is imported, and the test session
imports it for the interpreter (the shared compile helper drops TRITON_INTERPRET before it imports Triton).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.experiments
from benchmarks.experiments.compile_sm90 import compile_for_sm90, signature  # noqa: E402

# (kernel, constexprs besides PDL, pointer types, float arguments): the shapes of a Llama-3-8B layer
KERNELS = (
    ("add_rms_norm_kernel", {"HAS_RES": True, "BLOCK_T": 1, "BLOCK_N": 4096}, {}, ("eps",)),
    ("silu_mul_kernel", {"BLOCK_T": 1, "BLOCK_I": 1024}, {}, ()),
    ("qkv_rope_kernel", {"HQ": 32, "HKV": 8, "HALF": 64, "HALF_PAD": 64, "BLOCK_R": 16, "QK_NORM": False},
     {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}, ("eps",)),
    # the same storing k and v into the cache pages (write-through, KV_PAGE: its slots are step data)
    ("qkv_rope_kernel", {"HQ": 32, "HKV": 8, "HALF": 64, "HALF_PAD": 64, "BLOCK_R": 16, "QK_NORM": False,
                         "KV_PAGE": 16},
     {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}, ("eps",)),
)


def main() -> None:
    from kvgen.engine import fused_kernels

    out = {}
    for name, consts, pointers, floats in KERNELS:
        fn = getattr(fused_kernels, name)
        for pdl in (True, False):
            c = {**consts, "PDL": pdl}
            ptrs = {n: pointers.get(n, "*bf16") for n in fn.arg_names if n.endswith("_ptr")}
            ptx = compile_for_sm90(fn, signature(fn.arg_names, c, ptrs, floats), c, 4, 1).asm["ptx"]
            tag = f"{name}{'/kv' if consts.get('KV_PAGE') else ''}/pdl={int(pdl)}"
            out[tag] = {"wait": ptx.find("griddepcontrol.wait"),
                                            "launch_dependents": ptx.find("griddepcontrol.launch_dependents"),
                                            "first_load": ptx.find("ld.global")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
