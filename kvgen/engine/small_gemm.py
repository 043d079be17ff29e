"""Projections of a decode step's 5 to 64 rows: a Triton split-K GEMM on tensor cores, launched with PDL.

Why it exists: at batch 32 cuBLAS reads a Llama-3-8B layer's projections at
0.70-0.89 of the copy bandwidth on an H200 (q/k/v 0.75, o 0.70 plus
cuBLAS's split-K reduce kernels: the 2026-12-03 engine profile), and it
launches without programmatic dependent launch, so the decode graph's PDL
chain drains before and after each of them (:data:`.gemv.PDL_CHAIN_MS`).
This kernel (:mod:`.small_gemm_kernel`) computes ``out^T = w x^T`` so the
weight rows fill the MMA and the few rows of x are its N; it splits k
across programs where the matrix is too narrow to keep every SM streaming,
and the last program of a column block sums the partials (no second
kernel). Whether it runs for a projection is :func:`.gemv.choose`'s
decision, by timing it against cuBLAS. Its epilogues (SiLU * up, RoPE, the
residual add) and its prologue (an RMSNorm) take the step's elementwise
kernels into it (:func:`small_gemm`).

Rows are bucketed by the kernel's ``BLOCK_M`` (:data:`ROW_BLOCKS`): every
row count in a bucket runs the same config and tile, so an eager step of 20
rows sums each row in the order the graph of 32 does.

Launches that share this module's arrival counters (owner ``COUNTER_OWNER`` of
:mod:`kvgen.runtime.split_counters`) must not overlap in
their counter and partial accesses. kvgen runs them on one stream: plain
launches run in order, and a PDL launch overlaps the kernel before it only
up to its ``griddepcontrol.wait``, which precedes every counter, partial
and x access.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvgen.runtime.env import triton_interpret
from kvgen.runtime.split_counters import arrival_counters

from . import fused, pdl
from .kv_write import KVWrite

COUNTER_OWNER = "small GEMM"
ROW_BLOCKS = (16, 32, 64)
"""The kernel's BLOCK_M instances: a call of m rows runs the smallest that holds them."""
MAX_ROWS = ROW_BLOCKS[-1]
MIN_ROWS = 5
"""Fewer rows go to the GEMV (:mod:`.gemv`) or cuBLAS: a tensor-core tile of 16 rows would be mostly padding."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Config:
    """One launch configuration: the output column block, the k block, the k split and Triton's options."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4

    def describe(self) -> str:
        return f"{self.block_n}x{self.block_k}, split {self.split_k}, {self.num_warps} warps, {self.num_stages} stages"


TILES = ((64, 128, 6, 4), (64, 256, 4, 4), (128, 64, 3, 8), (256, 128, 3, 4))
"""(block_n, block_k, stages, warps) the chooser times, each with its k splits: the fastest of a wider sweep on an
H200 at 32 rows (Llama-3-8B shapes; benchmarks/experiments/small_gemm_sweep.py,
benchmarks/results/2026-12-04-nvidia-h200-4): 64-column blocks for the narrow q/k/v, o and down, 128 or 256 for
gate/up and the LM head. A tile whose stages do not fit the GPU's shared memory at a row bucket is skipped."""


def prefetch_blocks(config: Config, k: int, element_bytes: int) -> int:
    """The k blocks of its weight slice a PDL program of ``config`` asks L2 for before its wait, for a weight of
    ``k`` columns of ``element_bytes`` each: :func:`.pdl.prefetch_bytes` over a block's bytes, rounded down to a
    power of two (at least one block once set), and no more than the power of two that holds the program's share
    of k; 0 when that switch is off."""
    ask = pdl.prefetch_bytes()
    if not ask:
        return 0
    blocks = 1 << max(0, (ask // (config.block_n * config.block_k * element_bytes)).bit_length() - 1)
    share = -(-(k // config.block_k) // max(1, min(config.split_k, k // config.block_k)))
    return min(blocks, fused._pow2(share))


def shared_bytes(config: Config, block_m: int) -> int:
    """The shared memory a launch's pipeline stages take (its weight and x tiles), about what Triton asks for."""
    return (config.block_n + block_m) * config.block_k * 2 * config.num_stages


def row_block(rows: int) -> int:
    """The BLOCK_M instance that runs ``rows`` rows (``MIN_ROWS <= rows <= MAX_ROWS``)."""
    return next(b for b in ROW_BLOCKS if rows <= b)


def candidates(n: int, k: int, num_sms: int, rows: int | None = None,
               shared_limit: int | None = None) -> list[Config]:
    """The configs worth timing for a ``[n, k]`` weight on ``num_sms`` SMs: per tile of :data:`TILES` whose block
    divides k (and, given ``rows`` and ``shared_limit`` bytes, whose stages fit at that row bucket:
    :func:`shared_bytes`), the k splits from none up to the first that puts two programs on every SM."""
    out = []
    for block_n, block_k, stages, warps in TILES:
        if k % block_k:
            continue
        if rows is not None and shared_limit is not None and shared_bytes(
                Config(block_n, block_k, 1, warps, stages), row_block(rows)) > shared_limit:
            continue
        tiles, blocks = -(-n // block_n), k // block_k
        split = 1
        while split <= blocks:
            out.append(Config(block_n, block_k, split, warps, stages))
            if tiles * split >= 2 * num_sms:
                break
            split *= 2
    return out


@dataclass(frozen=True)
class Rope:
    """A q|k|v projection's RoPE for :func:`launch_supported`: ``heads_q`` and ``heads_kv`` heads of ``head_dim``
    dims (rows of the weight: q heads, then k, then v), ``positions`` int64 ``[m]``, ``cos``/``sin`` float32
    ``[max positions, head_dim / 2]`` (rotate-half form, :func:`.fused.qkv_rope`'s); ``write``: k and v go into
    the KV cache (:class:`KVWrite`), not into the result."""

    heads_q: int
    heads_kv: int
    head_dim: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    write: KVWrite | None = None


@dataclass(frozen=True)
class Norm:
    """An RMSNorm in front of a projection for :func:`launch_supported`: x is the residual stream a
    ``residual=`` launch just updated, ``stats`` that launch's float32 sums of squares ``[blocks, BLOCK_M]``,
    ``weight`` the norm's ``[K]`` and ``eps`` its epsilon."""

    stats: torch.Tensor
    weight: torch.Tensor
    eps: float


MAX_STATS = 256
"""The most column blocks whose sums of squares a NORM launch reads (one tile): a residual projection of up to
256 blocks (16,384 columns at the narrowest tile)."""


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config,
             gated: bool = False, rope: Rope | None = None, norm: Norm | None = None,
             residual: torch.Tensor | None = None) -> bool:
    """Whether :func:`small_gemm` takes these tensors with ``config``: ``MIN_ROWS..MAX_ROWS`` rows of x
    ``[m, K]`` with unit stride in k, a contiguous weight ``[N, K]`` of the same dtype and device, K a multiple
    of the config's k block, a contiguous bias ``[N]`` or none; ``gated``: N even (gate rows, then up rows);
    ``rope``: N = (q heads + 2 kv heads) x head_dim, half a column block dividing half a head (a program holds
    whole rotation pairs of one head), contiguous positions and tables on x's device, and a write's pools
    contiguous in x's dtype with int64 slots ``[m]``; ``norm``: contiguous
    float32 stats ``[1..MAX_STATS, x's row bucket]`` and a contiguous weight ``[K]`` of x's dtype; ``residual``: a
    plain projection (not gated, no rope, no norm), ``[m, N]`` of x's dtype with unit column stride, not sharing x's
    storage."""
    if x.dim() != 2 or weight.dim() != 2 or not MIN_ROWS <= x.shape[0] <= MAX_ROWS:
        return False
    if norm is not None:
        st, g = norm.stats, norm.weight
        if (st.dtype != torch.float32 or st.dim() != 2 or not 1 <= st.shape[0] <= MAX_STATS
                or st.shape[1] != row_block(x.shape[0]) or not st.is_contiguous() or st.device != x.device
                or g.dtype != x.dtype or g.shape != (weight.shape[1],) or not g.is_contiguous()
                or g.device != x.device):
            return False
    if residual is not None:
        if (gated or rope is not None or norm is not None or residual.dtype != x.dtype
                or residual.shape != (x.shape[0], weight.shape[0]) or residual.stride(1) != 1
                or residual.device != x.device
                or residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()):
            return False
    if gated and weight.shape[0] % 2:
        return False
    if rope is not None:
        half = rope.head_dim // 2
        if (rope.head_dim % 2 or weight.shape[0] != (rope.heads_q + 2 * rope.heads_kv) * rope.head_dim
                or half % (config.block_n // 2) or rope.positions.shape != (x.shape[0],)
                or rope.positions.dtype != torch.int64 or not rope.positions.is_contiguous()
                or any(t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != half or not t.is_contiguous()
                       or t.device != x.device for t in (rope.cos, rope.sin))
                or rope.positions.device != x.device):
            return False
        if rope.write is not None and not rope.write.fits(x.shape[0], rope.heads_kv, rope.head_dim, x.dtype,
                                                          x.device):
            return False
    K = weight.shape[1]
    # float32 only under the interpreter (tests): on a GPU tl.dot would round its inputs to tf32
    if (x.dtype not in _DTYPES or (x.dtype == torch.float32 and x.is_cuda) or weight.dtype != x.dtype
            or x.shape[1] != K or K % config.block_k or x.device != weight.device or not weight.is_contiguous()
            or x.stride(1) != 1):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.stride(0) == 1
                            and bias.device == x.device)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    from . import small_gemm_kernel

    if small_gemm_kernel.INTERPRET != interpret:
        raise RuntimeError("kvgen.engine.small_gemm_kernel was imported under the other TRITON_INTERPRET mode")
    return small_gemm_kernel.small_gemm_kernel


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config,
               gated: bool = False, rope: Rope | None = None, norm: Norm | None = None,
               residual: torch.Tensor | None = None):
    """``x [m, K] @ weight [N, K]^T (+ bias)`` -> a new ``[m, N]`` in x's dtype; float32 accumulation, one rounding.

    ``gated``: ``weight`` is a gate|up projection (gate rows, then as many up rows) and the result is
    ``silu(gate) * up`` ``[m, N/2]``, rounded as Hugging Face's eager MLP rounds (:func:`.fused.silu_mul`'s
    rounding): one kernel, no ``[m, N]`` intermediate. ``rope`` (a q|k|v projection, :class:`Rope`): the result
    is ``(q, k, v)``, RoPE applied to q and k, as :func:`.fused.qkv_rope` returns them for the plain projection;
    with ``rope.write`` it is ``(q, None, None)``, k and v stored into the cache pages (:class:`KVWrite`).
    ``residual`` (``[m, N]``, a pre-norm block's residual stream): ``residual += x weight^T (+ bias)`` in place,
    each rounded as Hugging Face rounds, and the result is ``(residual, stats)``, stats the float32 sums of
    squares of each row per column block that a ``norm=`` launch reads. ``norm`` (:class:`Norm`): x is such a
    residual stream and the projection is of its RMSNorm, ``rms_norm(x) @ weight^T``, normalized on the way in
    and rounded as :func:`.fused.rms_norm` rounds; its sum of squares comes from the stats in another order, so
    the result may differ from the norm kernel's by a rounding here and there.

    Runs on CUDA, or under the Triton interpreter on the CPU (tests). No host synchronization: CUDA graphs
    capture it (after a warm-up on the capture stream: :func:`kvgen.runtime.split_counters.arrival_counters`).
    Raises ValueError for tensors or a config it does not take (:func:`supports`), and Triton's OutOfResources at
    the first launch of a tile whose stages do not fit this GPU's shared memory.
    """
    interpret = triton_interpret()
    if (not supports(x, weight, bias, config, gated, rope, norm, residual)
            or x.device.type != ("cpu" if interpret else "cuda")):
        raise ValueError(f"small_gemm takes {MIN_ROWS}..{MAX_ROWS} rows of x [m, K] (unit stride in K) and a "
                         f"contiguous weight [N, K] of one dtype on one device (CUDA, or the CPU under "
                         f"TRITON_INTERPRET), K a multiple of {config.block_k}"
                         f"{', N even (gate|up)' if gated else ''}"
                         f"{', whole q/k/v heads and rope tables on its device' if rope is not None else ''}"
                         f"{', float32 stats [blocks, row bucket] and a norm weight [K]' if norm is not None else ''}"
                         f"{', a residual [m, N] apart from x (plain projections)' if residual is not None else ''}; "
                         f"got x {list(x.shape)} {x.dtype} strides {x.stride()} on {x.device}, "
                         f"weight {list(weight.shape)} {weight.dtype}")
    return launch_supported(x, weight, bias, config, interpret, gated, rope, norm, residual)


def launch_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: Config,
                     interpret: bool = False, gated: bool = False, rope: Rope | None = None,
                     norm: Norm | None = None, residual: torch.Tensor | None = None):
    """:func:`small_gemm` without its checks, for a caller that has checked :func:`supports` (``gemv.linear``,
    once a projection call); ``interpret``: the Triton interpreter runs it (CPU tensors). ``rope``: the result is
    ``(q, k, v)`` as :func:`.fused.qkv_rope` returns them for the plain projection (views of one new buffer);
    ``residual``: ``(residual, stats)``."""
    m, (N, K) = x.shape[0], weight.shape
    bm = row_block(m)
    if gated:  # a program reads block_n weight rows, half gate and half up, for block_n / 2 output columns
        N //= 2
    stats = None
    if rope is not None:  # one flat q | k | v buffer (fused.qkv_rope's), whole heads a program; q alone if written
        written = 0 if rope.write is None else 2 * rope.heads_kv * rope.head_dim
        out = torch.empty(m * (N - written), dtype=x.dtype, device=x.device)
        n_blocks = N // config.block_n
    elif residual is not None:  # updated in place; each column block's sums of squares beside it
        out = residual
        n_blocks = -(-N // config.block_n)
        stats = torch.empty(n_blocks, bm, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, N, dtype=x.dtype, device=x.device)
        n_blocks = -(-N // (config.block_n // 2 if gated else config.block_n))
    split = max(1, min(config.split_k, K // config.block_k))
    if split > 1:
        partials = torch.empty(split * n_blocks * bm * config.block_n, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, n_blocks, owner=COUNTER_OWNER, minimum=1024)
    else:
        partials = counters = out  # unused without a split
    opts = {}
    if not interpret:
        opts = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        if pdl.enabled(x):
            opts.update(PDL=True, launch_pdl=True)
            prefetch = prefetch_blocks(config, K, x.element_size())
            if prefetch:
                opts.update(PREFETCH=prefetch)
    trig = {} if rope is None else dict(ROPE_HQ=rope.heads_q, ROPE_HKV=rope.heads_kv, ROPE_HALF=rope.head_dim // 2)
    if norm is not None:
        trig.update(NORM=True, STATS_PAD=fused._pow2(norm.stats.shape[0]))
    if residual is not None:
        trig.update(RESIDUAL=True)
    kv = (out, out, out, 0)
    if rope is not None and rope.write is not None:
        kv = (rope.write.k, rope.write.v, rope.write.slots, rope.write.row_stride)
        trig.update(KV_PAGE=rope.write.page_size)
    stats_arg = norm.stats if norm is not None else (stats if stats is not None else out)
    _kernel(interpret)[(n_blocks, split)](
        x, weight, bias if bias is not None else out, out, partials, counters, m, N, K, x.stride(0),
        out.stride(0) if rope is None else 0, split, *((out, out, out) if rope is None else
                                                       (rope.positions, rope.cos, rope.sin)),
        stats_arg, out if norm is None else norm.weight, 0 if norm is None else norm.stats.shape[0],
        0.0 if norm is None else float(norm.eps), *kv,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT=split > 1, GATED=gated, **trig, **opts)
    if residual is not None:
        return out, stats
    if rope is None:
        return out
    hq, hkv, d = rope.heads_q, rope.heads_kv, rope.head_dim
    if rope.write is not None:
        return out.view(m, hq, d), None, None
    return (out[:m * hq * d].view(m, hq, d), out[m * hq * d:m * (hq + hkv) * d].view(m, hkv, d),
            out[m * (hq + hkv) * d:].view(m, hkv, d))
