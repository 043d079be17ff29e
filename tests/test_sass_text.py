"""The SASS readers the offline kernel analysis rests on (benchmarks/experiments/sass_text.py, cuda_sass.py): the
branch a tile loop skips its rare part with, the source lines of instructions, and the cost map of the CUDA
decode's tile loop built from them."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from benchmarks.experiments.sass_text import skipped_by_vote, source_lines
from kvgen.runtime import cuda_loader

LOOP = [
    (0x00, "LDS.128 R4, [R2]"),
    (0x10, "FMNMX R6, R4, R5, !PT"),
    (0x20, "VOTE.ANY P0, P1"),
    (0x30, "@!P0 BRA 0x60"),
    (0x40, "SHFL.BFLY PT, R7, R6, 0x4, 0x1f"),
    (0x50, "FMUL R8, R8, R9"),
    (0x60, "MUFU.EX2 R10, R10"),
    (0x70, "@P2 BRA 0x0"),
]


def test_skipped_by_vote_is_the_branch_body_after_the_vote():
    assert skipped_by_vote(LOOP) == {0x40, 0x50}
    # a backward branch after the vote is the loop's own, not a skip
    assert skipped_by_vote([(0x0, "VOTE.ANY P0, P1"), (0x10, "@P0 BRA 0x0")]) == set()
    assert skipped_by_vote(LOOP[:2]) == set()


NVDISASM = """\
.text.other:
\t//## File "/t/k.cu", line 3
        /*0000*/                   NOP ;
.text.kern:
kern:
\t//## File "/t/k.cu", line 10
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/usr/include/cuda_fp16.hpp", line 2604 inlined at "/t/k.cu", line 299
\t//## File "/t/k.cu", line 299 inlined at "/t/k.cu", line 365
\t//## File "/t/k.cu", line 365 inlined at "/t/k.cu", line 964
\t//## File "/t/k.cu", line 964
        /*0010*/                   HFMA2 R2, R2, R3, R4 ;
        /*0020*/                   HFMA2 R5, R5, R3, R4 ;
\t//## File "/t/k.cu", line 12
        /*0030*/                   EXIT ;
"""


def test_source_lines_follow_each_inlined_frame_outward():
    lines = source_lines(NVDISASM, "kern")
    assert lines[0x00] == [("/t/k.cu", 10)]
    inlined = [("/usr/include/cuda_fp16.hpp", 2604), ("/t/k.cu", 299), ("/t/k.cu", 365), ("/t/k.cu", 964)]
    assert lines[0x10] == inlined and lines[0x20] == inlined  # a line note holds until the next
    assert lines[0x30] == [("/t/k.cu", 12)]
    assert set(lines) == {0x00, 0x10, 0x20, 0x30}  # another function's instructions are not read
    assert source_lines(NVDISASM, "missing") == {}


@pytest.mark.skipif(cuda_loader.find_nvcc() is None, reason="nvcc (CUDA toolkit) not installed")
def test_int4_decode_cost_map_names_the_value_dequant():
    """Built for sm_90a: the tile loop's usual path leaves the lazy rescale out, and the cost map attributes the
    path's instructions to lines of the rendered kernel, the KIVI value dequant (dequant2) among the costliest."""
    from benchmarks.experiments import cuda_sass

    if cuda_sass.cuda_tool("nvdisasm") is None or cuda_sass.cuobjdump() is None:
        pytest.skip("no nvdisasm/cuobjdump (Triton's NVIDIA backend ships them)")
    args = argparse.Namespace(head_dim=128, gqa=8, page=16, instance="4,2", sass_dir=None, reg_cap_warps=None,
                              by_line=6)
    with tempfile.TemporaryDirectory() as tmp:
        out = cuda_sass.analyse("int4", args, Path(tmp))
    summary = next(line for line in out if "tile loop" in line)
    total, usual = (int(x) for x in summary.split("tile loop ")[1].split(" when")[0].replace("(", "").split())
    assert 0 < usual < total, summary
    costs = out[out.index(next(line for line in out if "come from" in line)) + 1:]
    assert len(costs) == 6
    counts = [int(line.split()[0]) for line in costs]
    assert counts == sorted(counts, reverse=True) and sum(counts) <= usual
    assert any("dequant2" in line or "__hfma2(code" in line for line in costs), costs
