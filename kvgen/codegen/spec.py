"""KernelSpec: everything that changes a generated kernel's source, and nothing else.

A KernelSpec is frozen and JSON-able; its stable hash names the generated
module, keys compile caches, and appears in every generated file's header.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

OPS = ("decode", "prefill", "cache_write", "page_quantize", "dequant", "page_copy")
COMPUTE_DTYPES = ("float16", "bfloat16", "float32")
BACKENDS = ("triton", "cuda")
"""Kernel languages: Triton (templates/triton) and CUDA C++ (templates/cuda)."""
BACKEND_CHOICES = BACKENDS + ("auto",)
"""``kvgen compile --backend``: every op in Triton; CUDA where a CUDA template serves the op (Triton for the
rest); or both where both exist (``KERNEL_VARIANTS`` of the package, all handed to the runtime, which runs one
per op: the one whose tuned configs time faster, decided by ``kvgen tune`` or at load with
``KVGEN_AUTOTUNE=sync`` and remembered; Triton until timed; see ``kvgen/runtime/backend_choice.py``)."""
_SCHEME_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class KernelSpec:
    """One specialized kernel: op x scheme x shape x dtype x arch.

    ``backend`` names the kernel language (:data:`BACKENDS`): it changes the
    source, so it is part of the hash. ``gqa_group`` is query heads per KV head; ``num_kv_heads`` the KV heads a
    rank holds (after TP sharding). ``sliding_window`` (tokens, or 0 for
    none) and ``softcap`` (0.0 for none) only matter to attention ops.
    """

    op: str
    scheme: str
    head_dim: int
    num_kv_heads: int
    gqa_group: int
    page_size: int
    compute_dtype: str
    arch: str
    backend: str = "triton"
    sliding_window: int = 0
    softcap: float = 0.0
    scheme_params: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")
        # The scheme name is written into the generated source (docstrings, messages): letters, digits, _ . - only.
        if not isinstance(self.scheme, str) or not _SCHEME_NAME.fullmatch(self.scheme):
            raise ValueError(f"scheme name {self.scheme!r} must be letters, digits, '_', '.' or '-'")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")

    def to_json(self) -> dict:
        data = asdict(self)
        data["scheme_params"] = [list(p) for p in self.scheme_params]
        return data

    def canonical(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """Readable and unique: ``decode_int4_d128_g8_p16_bfloat16_<hash8>``."""
        return f"{self.op}_{self.scheme}_d{self.head_dim}_g{self.gqa_group}_p{self.page_size}_{self.compute_dtype}_{self.hash[:8]}"
