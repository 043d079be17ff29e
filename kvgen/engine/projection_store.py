"""What :func:`.gemv.choose` decided for each projection, remembered across engine starts.

The chooser times cuBLAS against kvgen's GEMV and small GEMM for every
projection shape and row bucket of the decode graphs: some 25 decisions and
hundreds of timed candidates, 3.5-9.6 s at every start on an H200
(Llama-3-8B, benchmarks/results/2026-12-04-nvidia-h200-6). The decisions depend only on
the GPU, the kernels' code and the library versions, so they are kept where
the runtime keeps its tuned kernel configs (:class:`kvgen.runtime.autotune.
Autotuner`: one file per identity, device and Triton version under
``<KVGEN_CACHE_DIR>/autotune``, merged under a lock and written atomically),
under an identity that covers the GEMV's and the small GEMM's sources, the
chooser's and the timer's code, their config tables, the decision rule's
constants and torch's version with the CUDA it was built for: any change of
those, another GPU or another Triton times afresh. Not covered: the nvcc that
builds the GEMV and a cuBLAS upgraded without torch (they may change which
is faster, not what is correct).
``KVGEN_AUTOTUNE=off`` reads nothing remembered (and still writes what it
times).

A remembered choice is only a candidate: the chooser still runs it once and
checks its output against cuBLAS's before any graph keeps it, and times the
shape afresh when that check fails or the choice is not one it offers today.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch

from . import small_gemm

KEY_PREFIX = "projection/"
MISSING = object()
""":meth:`ProjectionStore.recall`'s answer where nothing usable is remembered (None means cuBLAS)."""


def identity(constants: dict[str, Any]) -> str:
    """A hex digest of the projection kernels' sources (``gemv.cu``, the small GEMM's kernel and launcher), the
    chooser's (``gemv.py``, ``pdl.py``) and the runtime timer's code, ``constants`` (the chooser's config tables
    and decision rule, by name) and torch's version with the CUDA it was built for."""
    from kvgen.runtime import kernel_timer

    here = Path(__file__).parent
    files = [here / n for n in ("gemv.cu", "small_gemm_kernel.py", "small_gemm.py", "gemv.py", "pdl.py")]
    h = hashlib.sha256()
    for path in [*files, Path(kernel_timer.__file__)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for name in sorted(constants):
        h.update(f"{name}={constants[name]!r}\0".encode())
    h.update(f"torch={torch.__version__}\0cuda={torch.version.cuda}\0".encode())
    return "projections-" + h.hexdigest()[:16]


def key(name: str, shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, rows: int, pdl: bool) -> str:
    """The entry of one decision: projection group, weight ``[N, K]``, dtype, bias, row bucket, PDL chain."""
    dt = str(dtype).removeprefix("torch.")
    return (f"{KEY_PREFIX}{name}/{shape[0]}x{shape[1]}/{dt}/{'bias' if has_bias else 'nobias'}/r{rows}/"
            f"{'pdl' if pdl else 'plain'}")


def encode(config: int | small_gemm.Config | None) -> dict[str, Any]:
    """A choice as the JSON ``config`` of its entry: cuBLAS, a GEMV config index or a small-GEMM config."""
    if config is None:
        return {"kernel": "cublas"}
    if isinstance(config, small_gemm.Config):
        return {"kernel": "small_gemm", **dataclasses.asdict(config)}
    return {"kernel": "gemv", "index": int(config)}


def decode(data: Any) -> int | small_gemm.Config | None | object:
    """The choice an entry's ``config`` names, or :data:`MISSING` for anything malformed."""
    if not isinstance(data, dict):
        return MISSING
    kind = data.get("kernel")
    if kind == "cublas" and len(data) == 1:
        return None
    if kind == "gemv" and set(data) == {"kernel", "index"} and type(data["index"]) is int:
        return data["index"]
    fields = {f.name for f in dataclasses.fields(small_gemm.Config)}
    if kind == "small_gemm" and set(data) == fields | {"kernel"} and all(type(data[f]) is int for f in fields):
        return small_gemm.Config(**{f: data[f] for f in fields})
    return MISSING


class ProjectionStore:
    """The chooser's decisions on one device, kept by a runtime :class:`~kvgen.runtime.autotune.Autotuner`.

    ``tuner`` None keeps nothing (every start times). ``constants``: what the chooser's decisions depend on
    besides the kernels' sources (see :func:`identity`).
    """

    def __init__(self, tuner: Any | None, constants: dict[str, Any]) -> None:
        self.tuner = tuner
        self.khash = identity(constants) if tuner is not None else ""

    def recall(self, entry_key: str) -> tuple[Any, float | None, float | None]:
        """``(choice, cublas_ms, kvgen_ms)`` remembered under ``entry_key``; choice :data:`MISSING` if none."""
        if self.tuner is None:
            return MISSING, None, None
        entry = self.tuner.remembered(self.khash, entry_key)
        if entry is None:
            return MISSING, None, None
        cublas_ms, ours = entry.get("cublas_ms"), entry.get("ms")
        if not isinstance(cublas_ms, (int, float)) or not (ours is None or isinstance(ours, (int, float))):
            return MISSING, None, None
        return decode(entry.get("config")), float(cublas_ms), None if ours is None else float(ours)

    def remember(self, entry_key: str, choice: int | small_gemm.Config | None, cublas_ms: float,
                 kvgen_ms: float | None) -> None:
        """Keep one decision and the times it was made on (for the start's summary line)."""
        if self.tuner is not None:
            self.tuner.remember(self.khash, entry_key, {"config": encode(choice), "cublas_ms": float(cublas_ms),
                                                        "ms": None if kvgen_ms is None else float(kvgen_ms)})
