"""The CUDA emulation's primitives (tests/cuda_emu/kvgen_emu.h) against host math written here independently of it:
mma.sync m16n8k16 (float16 and bfloat16) in the PTX ISA's fragment layouts, movmatrix, shuffles, votes, lop3,
prmt, the e4m3 conversion, and cp.async groups landing only at their wait (tests/cuda_emu/primitives.cpp runs them
in one warp). The decode tests on the emulation (test_cuda_decode.py) trust these."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ..cuda_emu import emulate
from .test_cuda_decode import EMU_BUILD_DIR

pytestmark = pytest.mark.skipif(emulate.toolchain() is None,
                                reason="the CUDA emulation needs g++ and the CUDA toolkit's headers")

FIELDS = ["a", "b", "c", "d", "bf_a", "bf_b", "bf_d", "t_in", "t_out", "shfl", "votes", "src", "before", "after",
          "final", "lop", "e4m3", "e4m3_out"]


class PrimArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in FIELDS]


def _bits16(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _pack(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 16-bit values per 32-bit word, lo in the low half (as uint32 in int64)."""
    return _bits16(lo) | (_bits16(hi) << 16)


def _fragments(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
    """The PTX ISA's m16n8k16 fragments of lane 4g + c: A (16 x 16) a0..a3, B (16 x 8) b0, b1, C (16 x 8) c0..c3."""
    a, b, c = [], [], []
    for lane in range(32):
        g, q = divmod(lane, 4)
        a += [_pack(A[g, 2 * q], A[g, 2 * q + 1]), _pack(A[g + 8, 2 * q], A[g + 8, 2 * q + 1]),
              _pack(A[g, 2 * q + 8], A[g, 2 * q + 9]), _pack(A[g + 8, 2 * q + 8], A[g + 8, 2 * q + 9])]
        b += [_pack(B[2 * q, g], B[2 * q + 1, g]), _pack(B[2 * q + 8, g], B[2 * q + 9, g])]
        c += [C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]]
    u32 = lambda xs: torch.tensor([int(x) for x in xs], dtype=torch.int64).to(torch.int32)  # noqa: E731
    return u32(a), u32(b), torch.stack(c).float()


def _unfragment_c(d: torch.Tensor) -> torch.Tensor:
    out = torch.empty(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, q = divmod(lane, 4)
        out[g, 2 * q], out[g, 2 * q + 1], out[g + 8, 2 * q], out[g + 8, 2 * q + 1] = d[4 * lane: 4 * lane + 4]
    return out


def _byte_perm(x: int, y: int, s: int) -> int:
    data = (y << 32) | x
    return sum(((data >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


@pytest.fixture(scope="module")
def run():
    src = (emulate.EMU_DIR / "primitives.cpp").read_text()
    lib = ctypes.CDLL(str(emulate.build(src, EMU_BUILD_DIR)))
    lib.run_primitives.argtypes = [ctypes.POINTER(PrimArgs)]
    lib.run_primitives.restype = ctypes.c_int
    gen = torch.Generator().manual_seed(0)
    A, B, C = torch.randn(16, 16, generator=gen), torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
    t = {}
    t["a"], t["b"], t["c"] = _fragments(A.half(), B.half(), C)
    t["bf_a"], t["bf_b"], _ = _fragments(A.bfloat16(), B.bfloat16(), C)
    t["d"], t["bf_d"] = torch.full((128,), float("nan")), torch.full((128,), float("nan"))
    t["t_in"] = torch.randint(-2**31, 2**31, (32,), generator=gen, dtype=torch.int64).to(torch.int32)
    t["t_out"] = torch.zeros(32, dtype=torch.int32)
    t["shfl"] = torch.zeros(32)
    t["votes"] = torch.zeros(32, dtype=torch.int32)
    t["src"] = torch.randint(0, 255, (64,), generator=gen, dtype=torch.uint8)
    for name in ("before", "after", "final"):
        t[name] = torch.zeros(64, dtype=torch.uint8)
    t["lop"] = torch.zeros(32, dtype=torch.int32)
    codes = torch.randint(0, 256, (32, 2), generator=gen, dtype=torch.uint8)
    codes[0] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # the two NaN codes
    codes[1] = torch.tensor([0x01, 0x80], dtype=torch.uint8)  # the smallest subnormal, -0
    t["e4m3"] = (codes[:, 0].to(torch.int32) | (codes[:, 1].to(torch.int32) << 8)).to(torch.int16)
    t["e4m3_out"] = torch.zeros(32, dtype=torch.int32)
    args = PrimArgs(**{name: t[name].data_ptr() for name in FIELDS})
    assert lib.run_primitives(ctypes.byref(args)) == 0
    return t, A, B, C, codes


def test_mma_matches_the_product_in_the_ptx_fragment_layouts(run):
    t, A, B, C = run[:4]
    for key, dtype in (("d", torch.float16), ("bf_d", torch.bfloat16)):
        want = A.to(dtype).double() @ B.to(dtype).double() + C.double()
        got = _unfragment_c(t[key].double())
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), key


def test_movmatrix_transposes_and_shuffles_and_votes_cross_lanes(run):
    t = run[0]
    words = [int(w) & 0xFFFFFFFF for w in t["t_in"]]
    elem = lambda r, k: (words[r * 4 + k // 2] >> (16 * (k % 2))) & 0xFFFF  # noqa: E731  (row r, column k)
    for lane in range(32):
        g, q = divmod(lane, 4)
        assert int(t["t_out"][lane]) & 0xFFFFFFFF == elem(2 * q, g) | (elem(2 * q + 1, g) << 16)
        assert float(t["shfl"][lane]) == (lane ^ 5) + 0.5
        assert int(t["votes"][lane]) == 1
        x, y = words[lane], words[31 - lane]
        assert int(t["lop"][lane]) & 0xFFFFFFFF == ((x & 0x000F000F) | 0x64006400) ^ _byte_perm(x, y, 0x0415 + lane % 3)


def test_e4m3_pairs_convert_exactly_and_nan_stays_nan(run):
    t, codes = run[0], run[4]
    got = t["e4m3_out"].view(torch.float16).view(32, 2).float()
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0]).all()
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.signbit(got[1, 1]) and got[1, 0] == 2.0 ** -9


def test_cp_async_lands_at_the_wait_that_retires_its_group(run):
    t = run[0]
    src = t["src"]
    poison = torch.full((32,), 0xFF, dtype=torch.uint8)
    assert torch.equal(t["before"], torch.full((64,), 0xFF, dtype=torch.uint8)), "a copy landed before any wait"
    assert torch.equal(t["after"], torch.cat([src[:32], poison])), "wait<1> retires each lane's oldest group only"
    assert torch.equal(t["final"], torch.cat([src[:48], torch.zeros(16, dtype=torch.uint8)])), "zero-fill"


def test_bank_model_counts_passes_and_wavefronts_as_the_hardware_serves_them():
    lib = ctypes.CDLL(str(emulate.build((emulate.EMU_DIR / "primitives.cpp").read_text(), EMU_BUILD_DIR)))
    out = (ctypes.c_ulonglong * 15)()
    lib.kvgen_emu_lds_stats(out, 1)
    assert lib.run_bank_patterns() == 0
    lib.kvgen_emu_lds_stats(out, 1)
    # reads, ideal passes, wavefronts: all, then by width 2, 4, 8, 16 bytes (tests/cuda_emu/primitives.cpp)
    assert list(out) == [7, 14, 73, 1, 1, 1, 3, 3, 34, 1, 2, 2, 2, 8, 36]
