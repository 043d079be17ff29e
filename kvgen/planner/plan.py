"""Plan: the planner's frozen, JSON-able output, with a reason for every decision."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Compute dtypes other than the default get a suffix in the package name; bfloat16 (the default) keeps
# the names packages had before the dtype was part of them (README, make run).
_DTYPE_SUFFIX = {"bfloat16": "", "float16": "_fp16", "float32": "_fp32"}


def package_name(model: str, target: str, scheme: str, options: Mapping[str, str], tp: int, page_size: int,
                 compute_dtype: str) -> str:
    """The plan's name, which is also its generated package's import name and folder name.

    A Python identifier: ``<model>_<target>_<scheme>[_<options digest>]_tp<N>_p<page>[_fp16|_fp32]``,
    with every run of other characters turned into ``_``. Two plans that compile to different
    kernels never share a name: scheme options enter as a digest, and the compute dtype as a
    suffix (none for bfloat16, the default, so those names stay as they were).
    """
    if compute_dtype not in _DTYPE_SUFFIX:
        raise ValueError(f"unknown compute dtype {compute_dtype!r}; known: {', '.join(_DTYPE_SUFFIX)}")
    opts = ""
    if options:
        opts = "_" + hashlib.sha256(json.dumps(dict(options), sort_keys=True).encode()).hexdigest()[:8]
    name = re.sub(r"[^0-9A-Za-z]+", "_", f"{model}_{target}_{scheme}{opts}_tp{tp}_p{page_size}").strip("_")
    if name[0].isdigit():
        name = "m_" + name
    return name + _DTYPE_SUFFIX[compute_dtype]


@dataclass(frozen=True)
class Plan:
    """Everything later stages need to know about the KV cache of one deployment.

    Byte counts are exact integers. ``kv_bytes_per_token`` covers the whole
    model (all layers and KV heads); ``*_per_gpu`` one tensor-parallel rank.
    ``num_pages``/``num_residual_pages`` are the per-GPU pool sizes (compressed
    pool, and the compute-dtype residual pool of schemes that keep one).
    ``page_tensors`` is the scheme's compressed page layout (name, dtype,
    shape per page and KV head) for the runtime to allocate. ``scheme_options``
    are the options the scheme was configured with (``--kv nuq4:codebook=F``);
    ``scheme`` plus them re-resolves the configured scheme (codegen does).
    With ``tiering == "host"``, ``host_transfer_ms_per_step`` is the host
    tier's KV over the host link each decode step and ``host_step_ms`` the
    predicted decode step (transfer overlapped with attention:
    :func:`kvgen.planner.host_cost.host_step_cost`); both 0 otherwise.
    """

    name: str
    model: str
    target: str
    scheme: str
    scheme_params: dict[str, Any]
    page_size: int
    compute_dtype: str
    tp: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    kv_heads_per_gpu: int
    q_heads_per_gpu: int
    kv_replication: int
    head_dim: int
    gqa_group: int
    sliding_window: int
    context: int
    concurrency: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    residual_bytes_per_token_per_gpu: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    workspace_bytes: int
    kv_budget_bytes: int
    num_pages: int
    num_residual_pages: int
    capacity_tokens: int
    capacity_sequences: int
    tiering: str
    host_tier_bytes: int
    host_transfer_ms_per_step: float
    arch: str
    page_tensors: list[dict[str, Any]] = field(default_factory=list)
    scheme_options: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    formulas: list[str] = field(default_factory=list)
    model_spec: dict[str, Any] = field(default_factory=dict)
    target_spec: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    host_step_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        return cls(**data)
