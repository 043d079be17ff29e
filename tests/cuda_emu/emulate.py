"""Run kvgen's CUDA decode kernels on the CPU, for tests.

:func:`load` renders a CUDA spec exactly as ``kvgen compile`` does, except
that ``cuda/platform.j2`` (the CUDA headers, inline PTX and the launch API:
templates/cuda/platform.j2) is this folder's, which includes
``kvgen_emu.h``: the same primitives as host C++ with one fiber per CUDA
thread (its header says what it models). The source is built with the host
C++ compiler against the CUDA toolkit's ``cuda_fp16.h``/``cuda_bf16.h`` into
a shared library, and :meth:`EmulatedDecode.launch` calls its
``kvgen_decode`` entry point on CPU tensors with the arguments the generated
module's own ``arguments`` builds (decode.py.j2; the library's ABI version is
checked against the module's).

Every template but the platform is the product's own text, so the
emulation checks the readers, the tile loop, the pipeline and the entry
points; the platform's PTX itself runs only on a GPU (``pytest -m gpu``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import jinja2

from kvgen.codegen import cuda as cuda_backend
from kvgen.codegen.loader import import_source
from kvgen.codegen.render import environment, header, layouts, template_hash
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import Registry, default_registry
from kvgen.runtime import cuda_loader
from kvgen.runtime.atomic_io import folder_lock, write_atomic
from kvgen.schemes import Scheme

EMU_DIR = Path(__file__).resolve().parent
HEADERS = ("kvgen_emu.h", "kvgen_emu_fibers.h", "kvgen_emu_banks.h")  # the first includes the others
CXX_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas",
             "-Wno-unused-variable", "-Wno-unused-but-set-variable")
BUILD_TIMEOUT_S = 600


def toolchain() -> tuple[str, Path] | None:
    """(host C++ compiler, CUDA include folder), or None where either is missing."""
    cxx = shutil.which("g++") or shutil.which("c++")
    include = _cuda_include()
    return (cxx, include) if cxx and include else None


@functools.lru_cache(maxsize=1)
def _cuda_include() -> Path | None:
    # CUDA_HOME, else the folder nvcc itself includes from (it may be a wrapper script elsewhere)
    roots = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    nvcc = cuda_loader.find_nvcc()
    if nvcc:
        try:
            dry = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                                 timeout=60).stderr
        except (OSError, subprocess.SubprocessError):
            dry = ""
        roots += [Path(m) for m in re.findall(r'INCLUDES="-I([^"\s]+)', dry)]
    return next((r for r in roots if (r / "cuda_fp16.h").is_file()), None)


def render(spec: KernelSpec, scheme: Scheme, registry: Registry | None = None,
           instance: tuple[int, int] | None = None) -> dict[str, str]:
    """``{".py", ".cu"}`` of a CUDA spec, the platform replaced by the emulation's; ``instance`` (warps, depth):
    build that template instance alone (a third of the build time of all six), else every one."""
    registry = registry or default_registry()
    base = environment(registry)
    env = base.overlay(loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(str(EMU_DIR)), base.loader]))
    L, R = layouts(spec, scheme)
    only = {} if instance is None else {"warps": (instance[0],), "depths": (instance[1],)}
    return cuda_backend.render(spec, scheme, L, R, env, header(spec, registry), template_hash(registry), **only)


def build(source: str, build_dir: Path, defines: tuple[str, ...] = ()) -> Path:
    """The emulation library of ``source`` in ``build_dir``, built once per source, defines, compiler and
    emulation headers (concurrent builders of one library both write it atomically). ``defines``: ``NAME=VALUE``
    macros (e.g. ``KVGEN_FP8_CVT=0``: the fp8 reader's path for devices before sm_89)."""
    tools = toolchain()
    if tools is None:
        raise RuntimeError("the CUDA emulation needs g++ and the CUDA toolkit's headers")
    cxx, include = tools
    flags = [*CXX_FLAGS, *(f"-D{d}" for d in defines)]
    lib = build_dir / f"decode-emu-{_key(source, *flags, *_toolchain_ids(cxx, include))}.so"
    if lib.exists():
        return lib
    pch = _precompiled_header(cxx, include, build_dir)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.cpp", Path(tmp) / "kernel.so"
        src.write_text(source)
        _run([cxx, *flags, "-shared", f"-I{pch}", f"-I{include}", "-include", HEADERS[0], "-x", "c++", str(src),
              "-o", str(out)])
        write_atomic(lib, out.read_bytes())
    return lib


@functools.lru_cache(maxsize=4)
def _toolchain_ids(cxx: str, include: Path) -> tuple[str, ...]:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    return (version, str(include), *((EMU_DIR / h).read_text() for h in HEADERS))


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if res.returncode:
        raise RuntimeError(f"emulation build failed: {' '.join(cmd)}\n{res.stderr[-6000:]}")


def _precompiled_header(cxx: str, include: Path, build_dir: Path) -> Path:
    """A folder with the emulation headers and kvgen_emu.h precompiled (half of a one-instance build is parsing
    them), made once under a lock; g++ uses the .gch where its flags match and reads the header otherwise."""
    folder = build_dir / f"pch-{_key(*CXX_FLAGS, *_toolchain_ids(cxx, include))}"
    if (folder / (HEADERS[0] + ".gch")).exists():
        return folder
    build_dir.mkdir(parents=True, exist_ok=True)
    with folder_lock(build_dir, BUILD_TIMEOUT_S):
        if not folder.exists():
            tmp = Path(tempfile.mkdtemp(dir=build_dir, prefix=".pch-"))
            for h in HEADERS:
                shutil.copyfile(EMU_DIR / h, tmp / h)
            _run([cxx, *CXX_FLAGS, f"-I{include}", "-x", "c++-header", str(tmp / HEADERS[0]), "-o",
                  str(tmp / (HEADERS[0] + ".gch"))])
            os.rename(tmp, folder)  # whole: a reader never sees a header without its .gch
    return folder


@dataclass
class EmulatedDecode:
    """A CUDA decode kernel built for the host: ``launch`` has the generated module's interface on CPU tensors."""

    module: ModuleType
    fn: ctypes._CFuncPtr  # kvgen_decode
    _error_string: ctypes._CFuncPtr
    _lds_stats: ctypes._CFuncPtr

    def launch(self, q, out, pools, block_tables, seq_lens, num_compressed, sm_scale, config=None):
        """decode.py.j2's ``launch`` on CPU tensors: the module's own ``arguments``, no stream, no PDL; raises
        RuntimeError with the entry point's error string on a failed launch."""
        tensors = [q, out, block_tables, seq_lens, num_compressed, *[pools[n] for n in self.module.POOL_TENSORS]]
        assert all(t.device.type == "cpu" for t in tensors), "the emulation runs on CPU tensors"
        call = self.module.arguments(q, out, pools, block_tables, seq_lens, num_compressed, sm_scale, config)
        if call is None:
            return out
        args, _workspace = call
        rc = self.fn(*args, None, 0)
        if rc:
            raise RuntimeError(f"emulated kernel launch failed: {self._error_string(rc).decode()} (code {rc})")
        return out

    def lds_stats(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """The emulation's count of shared-memory reads since the last reset, for every read (``"all"``) and by
        width (``"2"``, ``"4"``, ``"8"``, ``"16"`` bytes): warp-wide ``reads``, the ``ideal`` passes they need and
        the ``wavefronts`` their bank conflicts make them take (kvgen_emu_banks.h, account)."""
        out = (ctypes.c_ulonglong * 15)()
        self._lds_stats(out, int(reset))
        return {key: {"reads": out[3 * i], "ideal": out[3 * i + 1], "wavefronts": out[3 * i + 2]}
                for i, key in enumerate(("all", "2", "4", "8", "16"))}


def load(spec: KernelSpec, scheme: Scheme, build_dir: Path, *, config: dict | None = None, every_config=False,
         defines: tuple[str, ...] = (), registry: Registry | None = None) -> EmulatedDecode:
    """Render, build (cached in ``build_dir``; ``defines`` as :func:`build`) and load ``spec``'s decode kernel
    for the host: the instance of ``config`` alone (None: the default config's), or with ``every_config`` every
    instance the backend builds."""
    instance = None
    if not every_config:
        config = config or {}
        L, _ = layouts(spec, scheme)
        instance = (int(config.get("num_warps", 4)), int(config.get("depth", cuda_backend.depths_for(L)[0])))
    sources = render(spec, scheme, registry, instance)
    module = import_source(sources[".py"], f"{spec.name}_emu", directory=build_dir / "modules",
                           siblings={".cu": sources[".cu"]})
    lib = ctypes.CDLL(str(build(sources[".cu"], build_dir, defines)))
    lib.kvgen_abi_version.restype = ctypes.c_int
    if lib.kvgen_abi_version() != module.ABI_VERSION:
        raise RuntimeError(f"ABI {lib.kvgen_abi_version()} built, the module expects {module.ABI_VERSION}")
    fn = lib.kvgen_decode
    fn.argtypes = module.ARGTYPES
    fn.restype = ctypes.c_int
    lib.kvgen_error_string.argtypes = [ctypes.c_int]
    lib.kvgen_error_string.restype = ctypes.c_char_p
    lib.kvgen_emu_lds_stats.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    return EmulatedDecode(module, fn, lib.kvgen_error_string, lib.kvgen_emu_lds_stats)
