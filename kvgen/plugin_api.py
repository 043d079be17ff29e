"""What a plugin imports: the hook marker and the contracts it implements.

kvgen imports every plugin module to list its commands (``kvgen --help``)
and schemes (``kvgen plan``), so a plugin module must import quickly:
nothing heavy at module level. :func:`lazy_import` gives a module object
that imports on first attribute use, so a scheme's torch reference reads as
usual (``torch = lazy_import("torch")`` at the top, ``torch.where(...)`` in
``quantize_page``) while listing and planning never load torch.

Also here, so schemes share them rather than copy them: :func:`write_atomic`
(kvgen's one atomic-write helper, for a plugin's own files such as fitted
codebooks) and the numerics every quantized scheme follows
(:data:`FP16_LIMIT`, :func:`split_nonfinite`, :func:`half_toward_zero`; the
contract is in ``tests/kernels/test_numerics.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

import pluggy

from kvgen.atomic import write_atomic
from kvgen.errors import KvgenError, SchemeCapabilityError, SchemeOptionError
from kvgen.schemes import COMPUTE, PageTensor, Scheme

hookimpl = pluggy.HookimplMarker("kvgen")


class _LazyModule:
    """Stands for module ``name`` and imports it on the first attribute read (then forwards every read)."""

    def __init__(self, name: str):
        self.__name = name
        self.__module = None

    def __getattr__(self, attr: str) -> Any:
        if self.__module is None:
            self.__module = importlib.import_module(self.__name)
        return getattr(self.__module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__name!r} ({'imported' if self.__module is not None else 'not imported yet'})>"


def lazy_import(name: str) -> Any:
    """A stand-in for module ``name`` that imports it when an attribute is first read (``torch.float16``)."""
    return _LazyModule(name)


FP16_LIMIT = 65440.0
"""Largest magnitude a scheme with float16 scales/zeros stores (float16's 65504 less two of its top ulps).

Finite K/V beyond it saturate; each scheme caps its scales so that every dequantized value (and every
intermediate of its float16 decode path) stays finite, roundings included (see KIVI's and nuq4's docstrings)."""


def split_nonfinite(x: Any) -> tuple[Any, Any]:
    """``(x with its NaN/Inf entries set to 0, x * 0)`` for a float tensor ``x``.

    ``x * 0`` summed over a quantization group is 0, or NaN when the group holds
    a NaN or an Inf: added to the group's stored scale it makes the group read
    back as NaN, as a float page would (``amax`` alone would not do: GPU max
    reductions skip NaN). The kernels' macros compute the marker the same way.
    """
    torch = importlib.import_module("torch")
    zeros = x * 0
    return torch.where(zeros == 0, x, zeros.new_zeros(())), zeros


def half_toward_zero(x: Any) -> Any:
    """Float32 ``x >= 0`` as the float16 nearest it from below (a scale cap that rounding cannot push past)."""
    torch = importlib.import_module("torch")
    h = x.to(torch.float16)
    below = (h.view(torch.int16) - 1).view(torch.float16)
    return torch.where(h.float() > x, below, h)


def __getattr__(name: str) -> Any:
    # D and P are sympy symbols, created on first use (see kvgen.schemes.symbols).
    if name in ("D", "P"):
        from kvgen import schemes

        return getattr(schemes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["hookimpl", "lazy_import", "KvgenError", "SchemeCapabilityError", "SchemeOptionError", "Scheme",
           "PageTensor", "COMPUTE", "D", "P", "write_atomic", "FP16_LIMIT", "split_nonfinite", "half_toward_zero"]
