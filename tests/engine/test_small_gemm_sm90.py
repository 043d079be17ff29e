"""The small GEMM compiled for sm_90 (no GPU): its main loop streams both operands with cp.async into warpgroup
MMAs, and it keeps the PDL contract of kvgen/engine/pdl.py.

CPU tests run the kernel under the interpreter, where none of this shows: a row stride Triton could not prove
16-byte aligned once made it load x two bytes at a time, synchronously, at 0.3-0.8 of the copy bandwidth on the
H200. So CI compiles every row bucket and tile the chooser times (``small_gemm_sm90_build.py``, in a process of
its own) and reads the SASS and PTX.
"""

from __future__ import annotations

import pytest

from .helpers import sm90_build

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def builds():
    return sm90_build("small_gemm_sm90_build.py", timeout=900)


def test_main_loop_streams_with_cp_async_into_wgmma(builds):
    assert {b["block_m"] for b in builds} >= {16, 32, 64} and {b["split"] for b in builds} == {False, True}
    assert {b["gated"] for b in builds} == {False, True} and {b["rope"] for b in builds} == {False, True}
    assert {b["norm"] for b in builds} == {False, True} and {b["residual"] for b in builds} == {False, True}
    for b in builds:
        # the k loop: the one loop with warpgroup MMAs (not mma.sync); a split's combine loop has none
        mma_loops = [loop for loop in b["loops"] if loop["HGMMA"]]
        assert len(mma_loops) == 1, b
        loop = mma_loops[0]
        assert loop["LDGSTS"] > 0, b
        if b["norm"]:
            # x's tile normalized in registers, stored back for the MMA; the norm weight's one load is for the
            # next k step (loaded one iteration ahead)
            assert loop["LDG"] == 1 and loop["STS"] > 0, b
        else:
            assert loop["LDG"] == 0 and loop["STS"] == 0, b  # no synchronous load in it
        assert b["spill_bytes"] == 0, b


def test_pdl_wait_before_any_load_and_signal_after_it(builds):
    for b in builds:
        assert 0 <= b["wait"] < b["first_load"], b  # x is the previous kernel's output
        if b["kv"]:  # the decode after it launches as its programs exit, not early (small_gemm_kernel)
            assert b["launch_dependents"] == -1, b
        else:
            assert b["launch_dependents"] > b["wait"], b


def test_l2_prefetch_before_the_pdl_wait_and_the_loop_unchanged(builds):
    pre = [b for b in builds if b["prefetch"]]
    assert len(pre) == 2, [(b["tile"], b["prefetch"]) for b in pre]
    for b in pre:
        # the prefetches are issued while the previous kernel may still run: every one before the wait
        assert b["sass_prefetches"] and max(b["sass_prefetches"]) < b["sass_wait"], b
        # one per 128-byte line of PREFETCH k blocks of the tile's rows, spread over the threads (and at most
        # a few repeats where the layout holds an element twice)
        block_n, block_k, _, warps = b["tile"]
        lines = b["prefetch"] * block_k * 2 // 128 * block_n
        assert lines // (32 * warps) <= len(b["sass_prefetches"]) <= 2 * lines // (32 * warps), b
        twin = [o for o in builds if o["prefetch"] == 0 and all(o[f] == b[f] for f in (
            "block_m", "tile", "split", "gated", "rope", "norm", "residual", "kv"))]
        assert len(twin) == 1, b
        # the k loop, the registers and the PDL order are those of the build without the prefetch
        assert b["loops"] == twin[0]["loops"] and b["registers"] <= twin[0]["registers"], (b, twin[0])
        assert 0 <= b["wait"] < b["first_load"], b
    assert all(not b["sass_prefetches"] for b in builds if not b["prefetch"])


def test_write_through_leaves_the_k_loop_alone(builds):
    """The RoPE epilogue storing k and v into the cache pages (KV_PAGE) changes the epilogue only: the k loop and
    the PDL order are those of the same build storing them into its output, and nothing spills."""
    kv = [b for b in builds if b["kv"]]
    assert len(kv) == 2 and {b["split"] for b in kv} == {False, True}, kv
    for b in kv:
        twin = [o for o in builds if not o["kv"] and o["prefetch"] == 0 and all(o[f] == b[f] for f in (
            "block_m", "tile", "split", "gated", "rope", "norm", "residual"))]
        assert len(twin) == 1 and b["loops"][0] == twin[0]["loops"][0], (b, twin)
        assert b["spill_bytes"] == 0 and 0 <= b["wait"] < b["first_load"], b
