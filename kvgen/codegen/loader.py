"""Import rendered kernel source as a module (Triton's JIT needs a real file).

Used by tests and by in-process compiles; the generated package imports its
own files instead. Files are written atomically under the cache directory,
named by the spec hash and the template hash, so concurrent processes never
see a half-written module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from kvgen import env
from kvgen.atomic import write_atomic
from kvgen.codegen.render import render_sources
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import Registry, default_registry
from kvgen.schemes import Scheme


def import_source(source: str, module_name: str, directory: Path | None = None,
                  siblings: dict[str, str] | None = None) -> ModuleType:
    """Write ``source`` to ``<directory>/<module_name>_<digest>.py`` and import it.

    ``siblings`` (suffix -> text, e.g. a CUDA kernel's ``.cu``) are written
    first beside it under the same stem; the digest covers them too.
    """
    siblings = dict(siblings or {})
    h = hashlib.sha256(source.encode())
    for suffix, text in sorted(siblings.items()):
        h.update(f"\0{suffix}\0".encode() + text.encode())
    digest = h.hexdigest()[:12]
    directory = directory or env.cache_dir() / "kernels"
    path = directory / f"{module_name}_{digest}.py"
    for suffix, text in sorted(siblings.items()):
        other = path.with_suffix(suffix)
        if not other.exists() or other.read_text() != text:
            write_atomic(other, text.encode())
    if not path.exists() or path.read_text() != source:
        write_atomic(path, source.encode())
    qualified = f"kvgen_kernels.{path.stem}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def load_kernel(spec: KernelSpec, scheme: Scheme, registry: Registry | None = None) -> ModuleType:
    """Render ``spec`` (any backend) and import it; the module exposes ``launch(...)`` (see the op's template)."""
    sources = render_sources(spec, scheme, registry or default_registry())
    return import_source(sources.pop(".py"), spec.name, siblings=sources)
