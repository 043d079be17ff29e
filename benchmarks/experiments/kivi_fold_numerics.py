"""The CUDA KIVI decode's folded key scores emulated in numpy (no GPU): their error against exact scores.

    python -m benchmarks.experiments.kivi_fold_numerics

Two ways of scaling q before its float16 rounding (plugins/macros/cuda/kivi.j2, "Keys"): a fixed 2^-4 (``fixed``,
the kernel on main since a8d6762) and a power of two per warp that brings |q * sm_scale * log2(e)| to at most
C = 2^bits / 2 (``per-warp``, branch kivi-qfactor; with the scale cap C * scale <= 65504 it bounds every
q' * scale by 65504). Each case quantizes random keys as plugins/kivi.py does (clamp to 65440, min and max per
channel, the cap), then computes the scores as the kernel does: q' and q' * scale (and 2^-bits of that for the
codes one position up in a word) rounded to float16, codes as float16 subnormals, the zeros' term against q';
products exact and sums in float64 (the tensor cores' float32 sums are not modelled). Prints the largest score
error in log2 units and whether every score is finite.
"""

from __future__ import annotations

import numpy as np

FP16_LIMIT = 65440.0  # plugins/kivi.py: inputs are clamped here
CASES = ((1, 1), (0.05, 1), (4, 1), (1, 0.02), (1e-4, 3e4), (500, 2e4), (30, 3e4), (1e-3, 1))  # (q x, K x)


def h(x) -> np.ndarray:
    """Round to float16."""
    return np.asarray(x, dtype=np.float64).astype(np.float16)


def quantize(k: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, float16 scale and zero per channel over the rows of ``k`` (a page), capped as plugins/kivi.py does."""
    c, levels = 2 ** (bits - 1), 2 ** bits - 1
    k = np.clip(k, -FP16_LIMIT, FP16_LIMIT)
    zero = h(k.min(0))
    scale = h(np.minimum((k.max(0) - zero.astype(np.float64)) / levels, 65504.0 / c))
    code = np.clip(np.floor((k - zero.astype(np.float64)) / np.maximum(scale.astype(np.float64), 1e-30) + 0.5),
                   0, levels)
    return code, scale, zero


def exact_scores(q, code, scale, zero, qk) -> np.ndarray:
    keys = code * scale.astype(np.float64) + zero.astype(np.float64)
    return (keys * (q.astype(np.float64) * qk)).sum(-1)


def folded_scores(q, code, scale, zero, bits, qk, qf) -> np.ndarray:
    """The kernel's scores with q's factor ``qf``; odd channels stand for the codes one position up in a word."""
    qp = h(q.astype(np.float32) * np.float32(qk) * np.float32(qf)).astype(np.float64)
    zero_term = (zero.astype(np.float64) * qp).sum() * 2.0 ** -24
    up = np.arange(q.shape[0]) % 2 == 1
    with np.errstate(over="ignore", invalid="ignore"):
        b = h(qp * scale.astype(np.float64)).astype(np.float64)
        b = np.where(up, h(b * 2.0 ** -bits).astype(np.float64), b)
        codes = np.where(up, code * 2.0 ** bits, code) * 2.0 ** -24
        return (zero_term + (codes * b).sum(-1)) * (2.0 ** 24 / qf)


def warp_factor(amax: float, c: float) -> float:
    """The largest power of two f with amax * f <= c (as KFold::q_factor on branch kivi-qfactor)."""
    if not amax > 0 or not np.isfinite(amax):
        return 1.0
    _, ex = np.frexp(np.float32(amax) / np.float32(c))
    return float(np.ldexp(np.float32(1.0), -int(min(max(ex, -100), 100))))


def main() -> int:
    rng = np.random.default_rng(0)
    d, tokens = 128, 256
    qk = 1 / np.sqrt(d) * 1.4426950408889634
    for bits in (4, 2):
        c = 2 ** (bits - 1)
        print(f"--- {bits}-bit keys (C = {c}): largest score error, log2 units ---")
        for q_mul, k_mul in CASES:
            q = (rng.standard_normal(d) * q_mul).astype(np.float16).astype(np.float32)
            code, scale, zero = quantize(rng.standard_normal((tokens, d)) * k_mul, bits)
            exact = exact_scores(q, code, scale, zero, qk)
            fixed = folded_scores(q, code, scale, zero, bits, qk, 2.0 ** -4)
            qf = warp_factor(float(np.abs(q * np.float32(qk)).max()), c)
            warp = folded_scores(q, code, scale, zero, bits, qk, qf)
            err = {name: (np.abs(s - exact).max() if np.isfinite(s).all() else float("nan"))
                   for name, s in (("fixed", fixed), ("warp", warp))}
            print(f"q x {q_mul:<6g} K x {k_mul:<6g} score sd {np.std(exact):9.3g} | fixed 2^-4: {err['fixed']:9.3g}"
                  f" | per-warp 2^{int(np.log2(qf)):<3d}: {err['warp']:9.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
