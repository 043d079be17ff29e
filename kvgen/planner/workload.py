"""Workload: what the user wants to serve, validated."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvgen.errors import WorkloadError

COMPUTE_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                  "fp32": "float32", "float32": "float32"}


def host_memory_bytes(gib: float) -> int:
    """``--host-memory`` (GiB, a float) as bytes; WorkloadError for NaN, infinity or a negative size."""
    if not math.isfinite(gib) or gib < 0:
        raise WorkloadError(f"--host-memory must be a finite number of GiB >= 0, got {gib}; pass e.g. --host-memory 256")
    return int(gib * 2**30)


@dataclass(frozen=True)
class Workload:
    """Context length and concurrency to serve, TP degree, memory settings.

    ``page_size`` and ``weight_bits`` None mean "auto" (the planner decides). ``host_memory_bytes``
    bounds the host tier.
    """

    context: int = 4096
    concurrency: int = 1
    tp: int = 1
    gpu_memory_utilization: float = 0.90
    weight_bits: int | None = None
    page_size: int | None = None
    compute_dtype: str = "bfloat16"
    host_memory_bytes: int = 256 * 2**30

    def __post_init__(self) -> None:
        if self.context <= 0:
            raise WorkloadError(f"--context must be a positive number of tokens, got {self.context}")
        if self.concurrency <= 0:
            raise WorkloadError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.tp <= 0:
            raise WorkloadError(f"--tp must be at least 1, got {self.tp}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise WorkloadError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.weight_bits is not None and self.weight_bits not in (16, 8, 4):
            raise WorkloadError(f"--weight-bits must be 16, 8 or 4, got {self.weight_bits}")
        if self.page_size is not None and (self.page_size <= 0 or self.page_size & (self.page_size - 1)):
            raise WorkloadError(f"--page-size must be a power of two (8, 16, 32...) or 'auto', got {self.page_size}")
        if self.compute_dtype not in COMPUTE_DTYPES.values():
            raise WorkloadError(f"--dtype must be one of bf16, fp16, fp32, got {self.compute_dtype}")
        hm = self.host_memory_bytes
        if not (isinstance(hm, (int, float)) and math.isfinite(hm) and hm >= 0):
            raise WorkloadError(f"--host-memory must be a finite size >= 0, got {hm!r} bytes; pass e.g. --host-memory 256")

    def to_json(self) -> dict:
        return asdict(self)
