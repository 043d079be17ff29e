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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SCRIPT = Path(__file__).with_name("sm90_build.py")


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_prefill_kernels_build_for_sm90_without_spills(scheme, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # a real compile, not a cached one
    run = subprocess.run([sys.executable, str(SCRIPT), scheme], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    used = json.loads(run.stdout.strip().splitlines()[-1])
    assert [u["kernel"] for u in used] == ["_prefill_kernel"] + ["_prefill_staged_kernel"] * 3 + ["_stage_kernel"]
    for u in used:
        assert u["spill_bytes"] == 0, f"{scheme} {u}: register spills"
    assert used[1]["registers"] <= used[0]["registers"], used
