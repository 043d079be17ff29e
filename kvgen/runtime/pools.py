"""Page pool storage: allocate the tensors of one pool (plain torch, no kvgen imports).

A pool is a dict of tensors, one per page tensor a scheme declares, each
``[num_pages, num_kv_heads, *shape]`` and contiguous, so the data of one
page of one KV head is one contiguous block (see ``kvgen.schemes``). The
residual pool of a scheme with residual pages is the same thing with the
tensors ``rk``, ``rv`` of shape ``[page, head_dim]`` in the compute dtype.

This module ships inside every generated package (``kvgen/runtime`` imports
nothing from the rest of kvgen), so the descriptions it takes are plain
dicts, as they appear in ``plan.json``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

COMPUTE = "compute"
"""A dtype name meaning: the compute dtype of the plan."""

POISON_BYTE = 0xA5
"""Byte written into integer tensors by ``poison=True`` (an implausible code pattern)."""


def resolve_dtype(name: str | torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """A torch dtype from a dtype name (``"int8"``, ``"float8_e4m3fn"``...) or ``"compute"``."""
    if isinstance(name, torch.dtype):
        return name
    if name == COMPUTE:
        return compute_dtype
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown page tensor dtype {name!r}; use a torch dtype name or 'compute'")
    return dtype


def _field(t: Any, key: str) -> Any:
    # Accept plan.json dicts as well as objects with attributes (e.g. PageTensor).
    return t[key] if isinstance(t, Mapping) else getattr(t, key)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` in place with values no correct kernel may let reach a result.

    Floating tensors get NaN (float8 included); integer tensors get the byte
    pattern :data:`POISON_BYTE` in every byte. Returns ``tensor``.
    """
    if tensor.dtype.is_floating_point:
        tensor.fill_(float("nan"))
    else:
        tensor.view(torch.uint8).fill_(POISON_BYTE)
    return tensor


def allocate_pool(tensors: Iterable[Mapping[str, Any]], num_pages: int, num_kv_heads: int,
                  compute_dtype: torch.dtype, device: str | torch.device = "cpu", *,
                  poison: bool = False, zero: bool = False) -> dict[str, torch.Tensor]:
    """Allocate one pool: ``{name: tensor[num_pages, num_kv_heads, *shape]}``, contiguous.

    ``tensors``: dicts (or objects) with ``name``, ``dtype`` (a torch dtype
    name, or ``"compute"`` for ``compute_dtype``) and ``shape`` (per page and
    head). By default the memory is left uninitialized (``torch.empty``);
    ``zero=True`` zero-fills, ``poison=True`` fills with NaN / garbage bytes
    (see :func:`poison_`) so tests catch any read of a slot never written.
    """
    if num_pages < 0 or num_kv_heads <= 0:
        raise ValueError(f"a pool needs num_pages >= 0 and num_kv_heads > 0, got {num_pages}, {num_kv_heads}")
    pool: dict[str, torch.Tensor] = {}
    for t in tensors:
        name = _field(t, "name")
        if name in pool:
            raise ValueError(f"page tensor {name!r} declared twice")
        shape = tuple(int(s) for s in _field(t, "shape"))
        dtype = resolve_dtype(_field(t, "dtype"), compute_dtype)
        x = torch.empty((num_pages, num_kv_heads, *shape), dtype=dtype, device=device)
        if poison:
            poison_(x)
        elif zero:
            x.zero_()
        pool[name] = x
    return pool


def pool_bytes(pool: Mapping[str, torch.Tensor]) -> int:
    """Total bytes of a pool's tensors."""
    return sum(t.numel() * t.element_size() for t in pool.values())


def page_bytes(pool: Mapping[str, torch.Tensor]) -> int:
    """Bytes one page (all KV heads) occupies across the pool's tensors."""
    return sum(math.prod(t.shape[1:]) * t.element_size() for t in pool.values())
