"""What a tuned winner is keyed by: shape buckets, kernel identity, device and Triton version.

A winner found for one shape serves every shape of its **bucket** (each size
rounded up to a power of two, :func:`bucket`). It belongs to one kernel:
:func:`kernel_hash` says *what* the kernel computes (the KernelSpec hash) and
:func:`template_tag` *how* (the template it was rendered from), since a new
template may change which configs are fastest or even valid. It was timed on
one device (:func:`device_name`, whose SM count :func:`num_sms` the model of
the kernel reads) under one Triton version (:func:`_triton_version`). The
autotuner (:mod:`.autotune`) and its files (:mod:`.autotune_store`) build
their keys from these; nothing here reads or writes a file but a kernel
module's own source.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from types import ModuleType

import torch


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): the shape bucket of one dimension."""
    return 1 << max(0, int(n) - 1).bit_length()


def _source(module: ModuleType) -> str:
    path = getattr(module, "__file__", None)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


def kernel_hash(module: ModuleType, plan_hash: str | None = None) -> str:
    """The KernelSpec hash of a generated module.

    Prefers the hash recorded in plan.json; else recomputes it from the
    module's ``# spec: {...}`` header exactly as ``KernelSpec.hash`` does
    (sha256 of the compact, key-sorted JSON, 16 hex digits); else hashes the
    module's source (hand-written or test modules).
    """
    if plan_hash:
        return str(plan_hash)
    cached = getattr(module, "__kvgen_hash__", None)
    if cached:
        return cached
    source = _source(module)
    for line in source.splitlines()[:10]:
        if line.startswith("# spec: "):
            spec = json.loads(line[len("# spec: "):])
            canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
            return hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return hashlib.sha256((module.__name__ + "\n" + source).encode()).hexdigest()[:16]


def template_tag(module: ModuleType) -> str:
    """What the module was rendered from: its ``# template-hash:`` header, else a hash of its source.

    The KernelSpec hash names *what* a kernel computes; the template decides
    *how*, and with it which configs are fastest (or even valid). A module
    with neither header nor file (built in a test) gets ``"src-none"``.
    """
    source = _source(module)
    for line in source.splitlines()[:10]:
        if line.startswith("# template-hash: "):
            return _slug(line[len("# template-hash: "):].strip())[:32]
    if not source:
        return "src-none"
    return "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]


def device_name(device: torch.device | str) -> str:
    """The name winners timed on ``device`` are filed under: the CUDA device's name, else its type (``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    return 1


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "-", text).strip("-") or "unknown"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # triton missing: nothing can be tuned anyway
        return "none"
