"""Build a package's CUDA kernels at compile time (``kvgen compile --backend cuda|auto``).

The build itself (nvcc flags, cache key, library path) is
:mod:`kvgen.runtime.cuda_loader`'s, so a library built here is exactly the
one the generated package looks up at first load, written the same way;
only the lock is the compiler side's (:func:`kvgen.atomic.locked`: the
loader's ``flock``, with ``OutputError`` messages and a lock-file fallback).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvgen.atomic import locked
from kvgen.runtime import cuda_loader


def build_arch(arch: str) -> str | None:
    """The nvcc target for a plan's arch (``sm_90`` -> ``sm_90a``), or None if it is no CUDA arch."""
    m = re.fullmatch(r"sm_(\d+)(\d)[a-z]?", arch or "")
    if not m:
        return None
    return cuda_loader.arch_for_capability(int(m.group(1)), int(m.group(2)))


def build_source(source: str, arch: str, root: Path | None = None) -> Path:
    """The library of ``source`` for ``arch`` in the build cache (built now unless it is there)."""
    return cuda_loader.build(source, arch, root=root, locked=locked)


@dataclass
class BuildReport:
    """What a compile-time build did: libraries by package file, or why nothing was built."""

    libraries: dict[str, Path] = field(default_factory=dict)
    skipped: str | None = None


def build_package(files: dict[str, str], arch: str, root: Path | None = None) -> BuildReport:
    """Build every ``.cu`` file of a rendered package for the plan's ``arch``.

    Without nvcc, or for an arch that is not a CUDA one, nothing is built and
    ``skipped`` says why: the package then builds its kernels at first load.
    """
    sources = {path: text for path, text in sorted(files.items()) if path.endswith(".cu")}
    report = BuildReport()
    if not sources:
        return report
    target = build_arch(arch)
    if target is None:
        report.skipped = f"plan arch {arch!r} is not a CUDA arch; the kernels build at first load on the GPU"
        return report
    if cuda_loader.find_nvcc() is None:
        report.skipped = "nvcc not found; the CUDA kernels build at first load (nvcc needed there)"
        return report
    for path, text in sources.items():
        report.libraries[path] = build_source(text, target, root)
    return report
