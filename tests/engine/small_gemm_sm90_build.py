"""Compile the engine's small GEMM for sm_90 offline, per row bucket and tile; print what its PTX and SASS hold
as JSON.

    python tests/engine/small_gemm_sm90_build.py     (run by test_small_gemm_sm90.py in a fresh process)

A process of its own: Triton fixes interpreter or compiled mode when it is imported, and the test session
imports it for the interpreter (the shared compile helper drops TRITON_INTERPRET before it imports Triton).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.experiments
from benchmarks.experiments.compile_sm90 import compile_for_sm90, sass_of, signature  # noqa: E402
from benchmarks.experiments.sass_text import instructions, loop_bodies, opcode  # noqa: E402


def main() -> None:
    from kvgen.engine import small_gemm
    from kvgen.engine.small_gemm_kernel import small_gemm_kernel as fn

    out = []
    for block_m in small_gemm.ROW_BLOCKS:
        for block_n, block_k, stages, warps in small_gemm.TILES:
            if small_gemm.shared_bytes(small_gemm.Config(block_n, block_k, 1, warps, stages), block_m) > 227 << 10:
                continue  # does not fit an H100/H200's shared memory: the chooser does not time it there
            # the gated (gate|up with SiLU) and RoPE (Llama-3-8B's q|k|v) epilogues at the decode graphs' bucket of
            # 32 rows, RoPE where half a column block divides half a head
            # (split, gated, rope, norm, residual); at 32 rows also the residual epilogue (o, down) and the norm
            # prologue (after it: q/k/v, gate/up) with each epilogue
            epilogues = [(False, False, False, False, False), (True, False, False, False, False)]
            if block_m == 32:
                epilogues += [(False, True, False, False, False), (True, True, False, False, False),
                              (False, False, False, False, True), (True, False, False, False, True),
                              (True, False, False, True, False), (False, True, False, True, False)]
                if 64 % (block_n // 2) == 0:
                    epilogues += [(False, False, True, False, False), (True, False, True, False, False),
                                  (True, False, True, True, False)]
            # (split, gated, rope, norm, residual, prefetch): the L2 prefetch before the PDL wait at 32 rows, with
            # the plain and the norm + SiLU variants
            # (..., prefetch, kv): and the RoPE epilogue storing k and v into the cache pages (write-through)
            epilogues = [e + (0, False) for e in epilogues]
            if block_m == 32 and (block_n, block_k) == (64, 128):
                epilogues += [(True, False, False, False, False, 4, False), (True, False, True, True, False, 0, True),
                              (False, False, True, False, False, 0, True)]
            if block_m == 32 and (block_n, block_k) == (128, 64):
                epilogues += [(False, True, False, True, False, 8, False)]
            for split, gated, rope, norm, residual, prefetch, kv in epilogues:
                consts = {"HAS_BIAS": False, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                          "SPLIT": split, "PDL": True, "GATED": gated, "NORM": norm, "RESIDUAL": residual,
                          "STATS_PAD": 64, "ROPE_HQ": 0, "ROPE_HKV": 0, "ROPE_HALF": 0, "PREFETCH": prefetch,
                          "KV_PAGE": 16 if kv else 0}
                if rope:
                    consts.update(ROPE_HQ=32, ROPE_HKV=8, ROPE_HALF=64)
                ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                        "part_ptr": "*fp32", "counter_ptr": "*i32", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32", "stats_ptr": "*fp32", "norm_w_ptr": "*bf16", "kv_k_ptr": "*bf16",
                        "kv_v_ptr": "*bf16", "slot_ptr": "*i64"}
                # specialized as the JIT specializes at a Llama layer's launch: n, k and the row strides are
                # multiples of 16, the kernel's do_not_specialize arguments are not assumed to be
                k = compile_for_sm90(fn, signature(fn.arg_names, consts, ptrs, ("eps",)), consts, warps, stages,
                                     not_divisible=tuple(fn.do_not_specialize), divisible=("n", "k"))
                sass, regs, spills = sass_of(k)
                ptx = k.asm["ptx"]
                loops = [[opcode(i) for i in body] for body in loop_bodies(sass)]
                # the SASS in code order: the L2 prefetches (CCTL.E.PF2, not the split's cache invalidation) and
                # where the PDL wait (ACQBULK) falls among them
                ins = [i for _, i in instructions(sass)]
                ops = [opcode(i) for i in ins]
                wait_at = ops.index("ACQBULK") if "ACQBULK" in ops else -1
                out.append({"block_m": block_m, "tile": [block_n, block_k, stages, warps], "split": split,
                            "gated": gated, "rope": rope, "norm": norm, "residual": residual, "prefetch": prefetch,
                            "kv": kv,
                            "sass_prefetches": [j for j, op in enumerate(ops) if op == "CCTL" and ".PF" in ins[j]],
                            "sass_wait": wait_at,
                            "registers": regs, "spill_bytes": spills,
                            "loops": [{op: ops.count(op) for op in ("LDG", "LDGSTS", "STS", "HGMMA")}
                                      for ops in loops],
                            "wait": ptx.find("griddepcontrol.wait"),
                            "launch_dependents": ptx.find("griddepcontrol.launch_dependents"),
                            "first_load": min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
