"""The autotuner's model of the kernels: a predicted-best config per bucket, candidates ranked around it.

:func:`model_config` is what the runtime uses when nothing was tuned (the
request path never times); :func:`ranked_candidates` orders what tuning
times, nearest the model's prediction first; :func:`valid_config` checks a
persisted winner against what a kernel module accepts today.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

MAX_CANDIDATES = 8
"""Configs timed per bucket: the model's choice and its best-ranked neighbours."""


# -- the model ------------------------------------------------------------------
# Decode, H200 (132 SMs), benchmarks/results/2026-11-29-nvidia-h200 (bench-decode,
# decode_sweep, decode_pages, session3): the best configs read whole 128-token tiles
# (8 pages of 16) with 4 warps; stages 2 and 3 are within 1%. Splits only pay while
# batch x KV heads leaves SMs idle: at 256+ programs (B=32/64 x 8 heads) one split
# (no split combine) is best or within 2.5%; below one program per SM the winners
# run about 4 programs per SM (B=8 x 8 heads: 10-20 splits; B=16 x 4 heads at D=64:
# 10-20; B=1 x 8 heads: 33-66).
DECODE_TILE_TOKENS = 128
DECODE_WIDE_TILE_TOKENS = 32   # past D=128 (the template's own choice: K+V stages fit shared memory)
DECODE_PROGRAMS_PER_SM = 4
DECODE_MIN_TILES_PER_SPLIT = 4
"""A split streams at least this many tiles, as long as that still leaves a program per SM: the in-kernel
combine and each program's start are fixed costs. B=1, 16K tokens, 8 KV heads, 128-token tiles on an H200
(2026-12-02-nvidia-h200-3, CUDA-graph times): 33 splits (4 tiles each) decoded a layer in 26.0-26.1 us,
66 splits (2 tiles each) in 29.2 (final/ and timer/decode_timer.txt); 32 splits, this rule's choice, 25.1.
At 131072 tokens the cap leaves the 33-66 splits measured before; below about 2K tokens the
program-per-SM floor keeps the old choice (not measured there)."""


def decode_model(batch: int, kv_heads: int, max_seq_len: int, page: int, head_dim: int, sms: int,
                 max_splits: int = 128, min_pages_per_tile: int = 1) -> dict[str, int]:
    """The decode config the measurements predict best: ``{num_splits, pages_per_tile, num_warps, num_stages}``."""
    tokens = DECODE_TILE_TOKENS if head_dim <= 128 else DECODE_WIDE_TILE_TOKENS
    ppt = max(min_pages_per_tile, tokens // page)
    programs = max(1, batch * kv_heads)
    splits = 1 if programs >= sms else -(-DECODE_PROGRAMS_PER_SM * sms // programs)
    tiles = max(1, -(-max(1, -(-max_seq_len // page)) // ppt))
    splits = max(min(splits, tiles // DECODE_MIN_TILES_PER_SPLIT), min(-(-sms // programs), tiles))
    return {"num_splits": max(1, min(splits, tiles, max_splits)), "pages_per_tile": ppt,
            "num_warps": 4, "num_stages": 2}


def _is_decode_module(module: ModuleType) -> bool:
    return all(hasattr(module, n) for n in ("H", "PAGE", "HEAD_DIM", "MAX_SPLITS"))


def _distance(cfg: dict[str, Any], ideal: dict[str, Any], page: int) -> float:
    """How far a decode candidate is from the model's ideal (log2 steps; warps and stages count less)."""
    def log_gap(a, b):
        return abs(math.log2(max(1, int(a)) / max(1, int(b))))
    return (log_gap(cfg.get("num_splits", 1), ideal["num_splits"])
            + log_gap(int(cfg.get("pages_per_tile", 1)) * page, ideal["pages_per_tile"] * page)
            + 0.75 * (cfg.get("num_warps") != ideal["num_warps"])
            + 0.5 * (cfg.get("num_stages") != ideal["num_stages"]))


def ranked_candidates(op: str, module: ModuleType, sizes: tuple[int, ...], sms: int,
                      limit: int = MAX_CANDIDATES) -> list[dict[str, Any]]:
    """At most ``limit`` configs to time for one bucket (``sizes`` already bucketed), the model's choice first.

    Decode: the model's config, its split count halved and doubled (a
    runtime argument: no new compile), then the two compiled variants (tile,
    warps, stages among the module's candidates) nearest the model at the
    model's split count (one of them with another warp count, where the
    module offers one), then splits x4 and /4: at most three compiled
    variants plus the one-split one. Other ops: the module's own order (its
    default first).
    """
    cands = [dict(c) for c in module.candidates(*sizes)]
    first = model_config(op, module, sizes, sms, cands)
    out = [first] if first is not None else []
    if op == "decode" and _is_decode_module(module) and first is not None:
        ideal = _decode_ideal(module, sizes, sms)
        page, splits = int(module.PAGE), int(first["num_splits"])

        def at(cfg, n):
            ppt = int(cfg.get("pages_per_tile", 1))
            tiles = max(1, -(-max(1, -(-sizes[-1] // page)) // ppt))
            return dict(cfg, num_splits=max(1, min(int(n), tiles, int(module.MAX_SPLITS))))

        compiled = [k for k in first if k != "num_splits"]
        variants, seen = [], {tuple(first[k] for k in compiled)}
        for c in sorted(cands, key=lambda c: _distance(dict(c, num_splits=splits), ideal, page)):
            v = tuple(c.get(k) for k in compiled)
            if v not in seen:
                seen.add(v)
                variants.append(c)
        # one of the two compiled variants runs another warp count whenever the module offers one (Triton's too,
        # in place of its second-nearest tile or stage count): the distance ranks every stage count first, and the
        # CUDA KIVI readers at one split per (sequence, KV head) run 4-7% faster with 8 warps than with the
        # model's 4, which tuning never timed (2026-12-03-nvidia-h200-6)
        other_warps = next((v for v in variants if v.get("num_warps") != first.get("num_warps")), None)
        if other_warps is not None and other_warps not in variants[:2]:
            variants = [variants[0], other_warps]
        order = [at(first, splits * 2), at(first, splits // 2), *[at(v, splits) for v in variants[:2]],
                 at(first, splits * 4), at(first, splits // 4)]
    else:
        order = cands
    for c in order:
        if len(out) >= limit:
            break
        if c not in out:
            out.append(c)
    return out


def _decode_ideal(module: ModuleType, sizes: tuple[int, ...], sms: int) -> dict[str, int]:
    batch, seq = sizes[0], sizes[-1]
    return decode_model(batch, int(module.H), seq, int(module.PAGE), int(module.HEAD_DIM), sms,
                        int(module.MAX_SPLITS), int(getattr(module, "MIN_PAGES_PER_TILE", 1)))


def model_config(op: str, module: ModuleType, sizes: tuple[int, ...], sms: int,
                 cands: list[dict[str, Any]] | None = None, device: torch.device | str | None = None
                 ) -> dict[str, Any] | None:
    """The config used for a bucket nothing was tuned for (``sizes`` already bucketed).

    Decode modules: the candidate nearest :func:`decode_model` in its compiled
    parameters (tile, warps, stages: so it is always one the kernel offers),
    with the model's split count. Others: the module's ``default_config``.
    """
    if op == "decode" and _is_decode_module(module) and hasattr(module, "candidates"):
        ideal = _decode_ideal(module, sizes, sms)
        cands = cands if cands is not None else [dict(c) for c in module.candidates(*sizes)]
        if cands:
            page = int(module.PAGE)
            best = min(cands, key=lambda c: _distance(dict(c, num_splits=ideal["num_splits"]), ideal, page))
            ppt = int(best.get("pages_per_tile", ideal["pages_per_tile"]))
            tiles = max(1, -(-max(1, -(-sizes[-1] // page)) // ppt))
            return dict(best, num_splits=max(1, min(ideal["num_splits"], tiles, int(module.MAX_SPLITS))))
        return ideal
    fn = getattr(module, "default_config", None)
    if fn is None:
        return None
    if device is None:
        device = "cuda" if sms > 1 else "cpu"
    return dict(fn(*sizes, device=torch.device(device)))


def valid_config(config: Any, module: ModuleType, sizes: tuple[int, ...], device: torch.device | str = "cpu") -> bool:
    """Whether ``config`` is one the kernel can launch: keys and values as its candidates use them.

    Every key of the module's default config must be there and no other;
    each value must be an int (never a bool) that some candidate (or the
    default) uses for that key, except ``num_splits``, a runtime argument
    that may be any value from 1 to the module's ``MAX_SPLITS``.
    """
    if not isinstance(config, dict) or not config:
        return False
    try:
        known = [dict(c) for c in getattr(module, "candidates", lambda *a: [])(*sizes)]
        fn = getattr(module, "default_config", None)
        if fn is not None:
            known.append(dict(fn(*sizes, device=torch.device(device))))
    except Exception:
        return False
    if not known:
        return False
    keys = set(known[-1])
    if set(config) != keys:
        return False
    for k, v in config.items():
        if not isinstance(v, int) or isinstance(v, bool):
            return False
        if k == "num_splits" and hasattr(module, "MAX_SPLITS"):
            if not 1 <= v <= int(module.MAX_SPLITS):
                return False
        elif v not in {c.get(k) for c in known}:
            return False
    return True
