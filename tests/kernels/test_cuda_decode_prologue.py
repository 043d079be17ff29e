"""The CUDA decode's prologue, read from its sm_90a SASS (offline: nvcc and Triton's cuobjdump, no GPU).

A reader that folds its key scales (KIVI) reduces |q| across the warp (five shuffles) before its first tile's
copies; the copies need the tiles' block-table entries. templates/cuda/decode_tiles.j2 loads those entries before
q's maximum and makes the maximum depend on them, so that ptxas issues their loads with q's: otherwise it placed
them after the shuffles, and every warp's first pages arrived a memory round trip later (fd7eb66; measured on the
H200: benchmarks/results/2026-12-05-nvidia-h200-3/fold/, variant `prologue`).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.experiments import cuda_sass

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed: CUDA templates not built")
@pytest.mark.parametrize("scheme", ["int4", "int2"])
def test_first_block_table_loads_issue_before_the_key_folds_shuffles(scheme, tmp_path):
    tool = cuda_sass.cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's)")
    src = tmp_path / f"{scheme}.cu"
    src.write_text(cuda_sass.render(scheme, 128, 8, 16))
    cubin = tmp_path / f"{scheme}.cubin"
    subprocess.run([NVCC, *cuda_sass.NVCC_FLAGS, "-o", str(cubin), str(src)], check=True, capture_output=True)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels = {name: instrs for name, instrs in cuda_sass.functions(sass).items() if cuda_sass.INSTANCE.search(name)}
    assert kernels, "no decode_kernel instance in the cubin"
    for name, instrs in kernels.items():
        texts = [t for _, t in instrs]
        first_shuffle = next(i for i, t in enumerate(texts) if t.startswith("SHFL.BFLY"))
        # the block-table entries are the kernel's read-only (__ldg) loads; q's and seq_len's are plain LDG.E
        table_loads = [i for i, t in enumerate(texts[:first_shuffle]) if "LDG.E.CONSTANT" in t]
        assert table_loads, f"{name}: no block-table load before q's warp-wide maximum"
        # every prologue entry (one per stage of the ring but the last) is read before the shuffles
        depth = int(cuda_sass.INSTANCE.search(name).group(2))
        assert len(table_loads) >= depth - 1, (name, len(table_loads))
