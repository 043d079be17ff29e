"""The prefill module's Triton kernels compile for sm_90 on a machine without a GPU, without spilling.

The interpreter runs the kernels' Python semantics only: a construct the
Triton compiler rejects (or a tile that spills registers) would pass every
CPU test and fail on the first GPU. Triton ships ptxas, so CI compiles the
in-place, staged and staging kernels (``sm90_build.py``, in a process of its
own, outside the interpreter) for sm_90 at D=128, GQA 8, bf16 and the tile
sizes the GPU candidates use (the staged default's 128-token, 3-stage tile
too), and reads the cubin's register and local-memory use. The staged
attention kernel reads plain pages, so it must not need more registers than
the in-place kernel of the same tile.

Spills are read from cuobjdump's STACK frame (where ptxas puts them) as
well as LOCAL; reading LOCAL alone, as this check once did, never saw one.
Read so, triton 3.9 spills 144 bytes in the kernels of the GPU default tile
(16 x 128, 8 warps, 3 stages) when a chunk comes with fresh K/V: about 16
spill loads and stores in each masked loop (the diagonal tiles, one or two
per query block), none in the whole-tile loops that run every other tile;
triton 3.6 (the H200 machine's) spills nothing there. Since fb466c0 (the
float reader's one-offset-a-token addresses, 9% faster prefill on the H200)
triton 3.9 also spills 5 instructions in the fresh chunk's whole-tile loop of
that staged kernel (152 bytes in all); not checked against triton 3.6. So the
check is that no whole-tile loop over pages spills, the fresh chunk's at most
FRESH_SPILL_LIMIT instructions, and any other spill is reported as a warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from benchmarks.experiments.sass_text import loop_bodies, opcode, resource_usage

triton = pytest.importorskip("triton")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SCRIPT = Path(__file__).with_name("sm90_build.py")
FRESH_SPILL_LIMIT = 8  # spill instructions in the fresh chunk's whole-tile loop (5 with triton 3.9; see above)


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_prefill_kernels_build_for_sm90_without_spills_in_whole_tile_loops(scheme, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # a real compile, not a cached one
    run = subprocess.run([sys.executable, str(SCRIPT), scheme], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    assert [u["kernel"] for u in used] == ["_prefill_kernel"] + ["_prefill_staged_kernel"] * 3 + ["_stage_kernel"]
    for u in used[:-1]:  # the attention kernels: each token range a whole-tile loop, then its masked loop
        masked = [loop["masked"] for loop in u["loops"]]
        assert len(masked) >= 4 and masked == [False, True] * (len(masked) // 2), f"{scheme} {u}"
    for u in used:
        hot = [loop for loop in u["loops"] if not loop["masked"]]
        # the attention kernels' loops come pool first, then (FRESH) the fresh chunk's
        fresh = hot[1:] if u["constexprs"].get("FRESH") else []
        pool = hot[:1] if fresh else hot
        assert all(loop["spill_instructions"] == 0 for loop in pool), f"{scheme} {u}: a whole-tile loop over pages spills"
        assert all(loop["spill_instructions"] <= FRESH_SPILL_LIMIT for loop in fresh), \
            f"{scheme} {u}: the fresh chunk's whole-tile loop spills more than {FRESH_SPILL_LIMIT} instructions"
        if u["spill_bytes"]:
            warnings.warn(f"{scheme} {u['kernel']} {u['constexprs']}: {u['spill_bytes']} bytes of spills outside "
                          f"its whole-tile loops ({[loop['spill_instructions'] for loop in u['loops']]} a loop)")
    assert used[1]["registers"] <= used[0]["registers"], used


def test_spills_are_read_from_the_stack_frame_and_local_memory():
    usage = " Function k:\n  REG:255 STACK:72 SHARED:1024 LOCAL:8 CONSTANT[0]:624 TEXTURE:0\n"
    assert resource_usage(usage) == (255, 80)
    assert resource_usage(usage.replace("STACK:72", "STACK:0").replace("LOCAL:8", "LOCAL:0")) == (255, 0)
    with pytest.raises(ValueError, match="no register line"):
        resource_usage("Resource usage:\n")


def test_loops_are_the_spans_of_backward_branches():
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   FSEL R2, R3, -INF , P0 ;",
        "        /*0020*/              @!P1 STL [R1], R2 ;",
        "        /*0030*/               @P0 BRA 0x10 ;",
        "        /*0040*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR6][R6.64] ;",
        "        /*0050*/                   BRA 0x40 ;",
        "        /*0060*/                   EXIT ;",
    ])
    bodies = loop_bodies(sass)
    assert [[opcode(i) for i in b] for b in bodies] == [["FSEL", "STL", "BRA"], ["LDGSTS", "BRA"]]
