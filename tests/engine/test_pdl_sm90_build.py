"""The engine's fused kernels keep the PDL contract of kvgen/engine/pdl.py once compiled for sm_90 (no GPU).

CPU tests run these kernels under the interpreter, where PDL is off, and the GPU test that PDL graphs give
plain launches' tokens runs only on the device. So CI compiles them for sm_90 (``pdl_sm90_build.py``, in a
process of its own) and reads the PTX: with PDL, each waits for the previous kernel before its first global
load; the residual-add + RMSNorm and SiLU kernels then let the next kernel (a projection) launch, right after
the wait; q/k/v RoPE does not (its next kernels are the attention path's: signalling there cost int4 3.5% a
step at batch 32 on the H200). Without PDL neither instruction is there.
"""

from __future__ import annotations

import pytest

from .helpers import sm90_build

pytest.importorskip("triton")

EARLY = {"add_rms_norm_kernel", "silu_mul_kernel"}


@pytest.fixture(scope="module")
def ptx_marks():
    return sm90_build("pdl_sm90_build.py", timeout=600)


@pytest.mark.parametrize("kernel", ["add_rms_norm_kernel", "silu_mul_kernel", "qkv_rope_kernel", "qkv_rope_kernel/kv"])
def test_pdl_wait_and_early_signal_where_the_contract_says(ptx_marks, kernel):
    on, off = ptx_marks[f"{kernel}/pdl=1"], ptx_marks[f"{kernel}/pdl=0"]
    assert 0 <= on["wait"] < on["first_load"], on  # nothing is read before the previous kernel is done
    if kernel in EARLY:  # (the RoPE kernel storing k and v into the cache: the decode follows it too)
        assert on["wait"] < on["launch_dependents"] < on["first_load"], on
    else:
        assert on["launch_dependents"] == -1, on
    assert off["wait"] == off["launch_dependents"] == -1, off
