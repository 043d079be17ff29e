"""What a plugin imports: the hook marker and the contracts it implements.

kvgen imports every plugin module to list its commands (``kvgen --help``)
and schemes (``kvgen plan``), so a plugin module must import quickly:
nothing heavy at module level. :func:`lazy_import` gives a module object
that imports on first attribute use, so a scheme's torch reference reads as
usual (``torch = lazy_import("torch")`` at the top, ``torch.where(...)`` in
``quantize_page``) while listing and planning never load torch.

Also here, so plugins share it rather than copy it: :func:`write_atomic`
(kvgen's one atomic-write helper, for a plugin's own files such as fitted
codebooks).
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


def __getattr__(name: str) -> Any:
    # D and P are sympy symbols, created on first use (see kvgen.schemes.symbols).
    if name in ("D", "P"):
        from kvgen import schemes

        return getattr(schemes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["hookimpl", "lazy_import", "KvgenError", "SchemeCapabilityError", "SchemeOptionError", "Scheme",
           "PageTensor", "COMPUTE", "D", "P", "write_atomic"]
