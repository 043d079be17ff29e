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
from kvgen.codegen.render import render_kernel
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import Registry, default_registry
from kvgen.schemes import Scheme


def import_source(source: str, module_name: str, directory: Path | None = None) -> ModuleType:
    """Write ``source`` to ``<directory>/<module_name>_<digest>.py`` and import it."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    directory = directory or env.cache_dir() / "kernels"
    path = directory / f"{module_name}_{digest}.py"
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
    """Render ``spec`` and import it; the module exposes ``launch(...)`` (see the op's template)."""
    return import_source(render_kernel(spec, scheme, registry or default_registry()), spec.name)
