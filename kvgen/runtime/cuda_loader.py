"""Build and load the CUDA kernels of a generated package: torch, ctypes and the standard library only.

A CUDA kernel module (``kernels/<op>.py``) carries its CUDA C++ source
beside it (``kernels/<op>.cu``). :func:`load_function` returns the C
function of the shared library built from that source for the device's
architecture, building it with nvcc first if the build cache lacks it.

Build cache: ``<KVGEN_CACHE_DIR>/cuda/<source-key>-<arch>-nvcc<version>.so``
where ``source-key`` hashes the source, the nvcc flags and the build format
(:func:`library_path`). The name is the key: a changed template, arch or
compiler never reuses a stale library. When nvcc is absent at run time, a
library built by the same source and arch with any nvcc version is used
(``kvgen compile --backend cuda`` may have built it); only if there is none
does loading fail, with a message saying what to install.

Writes: nvcc runs in a private temporary folder, then the library's bytes
are written atomically (:func:`.atomic_io.write_atomic`, kvgen's one
atomic-write helper) under an ``flock`` on the ``cuda`` cache folder itself
(:func:`.atomic_io.folder_lock`, which :func:`kvgen.atomic.locked` also
takes; the compiler side passes that as ``locked=``), so ``kvgen compile``
and a loading application exclude each other and neither ever sees half a
library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from .atomic_io import LockTimeout, folder_lock, write_atomic
from .env import cache_dir
from .errors import KvgenRuntimeError

BUILD_FORMAT = "1"
NVCC_FLAGS = ("-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC", "-lineinfo")
LOCK_TIMEOUT_S = 600.0  # a build of a large template on a busy machine can take minutes
_NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc",)


class CudaBuildError(KvgenRuntimeError):
    """A CUDA kernel could not be built or loaded (no nvcc, a failed build, a launch error)."""


def error(message: str) -> CudaBuildError:
    return CudaBuildError(message)


def find_nvcc() -> str | None:
    """Path of nvcc: on PATH, else the usual CUDA install folder; None when there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    return next((p for p in _NVCC_CANDIDATES if os.access(p, os.X_OK)), None)


_VERSIONS: dict[str, str] = {}


def nvcc_version(nvcc: str) -> str:
    """``13.0.88`` from ``nvcc --version`` (cached per path)."""
    if nvcc not in _VERSIONS:
        try:
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise CudaBuildError(f"cannot run {nvcc} --version ({exc}); check the CUDA toolkit install") from None
        m = re.search(r"V(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
        _VERSIONS[nvcc] = m.group(1) if m else hashlib.sha256(text.encode()).hexdigest()[:12]
    return _VERSIONS[nvcc]


def arch_for_capability(major: int, minor: int) -> str:
    """The build target of a device: ``sm_90a`` on Hopper (its arch-specific features), else ``sm_<major><minor>``."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    return f"sm_{major}{minor}"


def gencode(arch: str) -> list[str]:
    """nvcc's target flags for ``arch`` (``sm_90a`` -> ``-gencode=arch=compute_90a,code=sm_90a``)."""
    m = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if not m:
        raise CudaBuildError(f"arch must look like sm_90a or sm_80, got {arch!r}")
    return [f"-gencode=arch=compute_{m.group(1)},code={arch}"]


def source_key(source: str) -> str:
    """Hash of everything but the arch and nvcc that changes the library: source, flags, build format."""
    h = hashlib.sha256()
    for part in (BUILD_FORMAT, " ".join(NVCC_FLAGS), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def library_path(source: str, arch: str, version: str, root: Path | None = None) -> Path:
    """Where the library of ``source`` built for ``arch`` by nvcc ``version`` lives in the build cache."""
    root = root if root is not None else cache_dir()
    gencode(arch)  # validates the arch before it becomes part of a file name
    if not re.fullmatch(r"[0-9A-Za-z.]+", version):
        raise CudaBuildError(f"unexpected nvcc version string {version!r}")
    return root / "cuda" / f"{source_key(source)}-{arch}-nvcc{version}.so"


def nvcc_command(nvcc: str, src: Path, out: Path, arch: str) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *gencode(arch), "-o", str(out), str(src)]


def compile_source(source: str, arch: str, nvcc: str) -> bytes:
    """The shared library nvcc builds from ``source`` for ``arch`` (in a private temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="kvgen-nvcc-") as tmp:
        src, out = Path(tmp) / "kernel.cu", Path(tmp) / "kernel.so"
        src.write_text(source, encoding="utf-8")
        try:
            proc = subprocess.run(nvcc_command(nvcc, src, out, arch), capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CudaBuildError(f"could not run nvcc ({exc}); check the CUDA toolkit install") from None
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise CudaBuildError(f"nvcc failed to build a kvgen CUDA kernel for {arch} (a kvgen bug; "
                                 f"please report it): {tail}")
        return out.read_bytes()


@contextlib.contextmanager
def _locked(directory: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """The flock on the folder itself (:func:`.atomic_io.folder_lock`, as kvgen.atomic.locked takes it).

    Where the folder cannot be opened or locked, no lock: the write itself stays atomic.
    """
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(folder_lock(directory, timeout))
    except LockTimeout:
        raise CudaBuildError(f"another process has been building in {directory} for over {timeout:g} s; "
                             "wait for it or stop it, and try again") from None
    except OSError:
        pass
    with stack:
        yield


def build(source: str, arch: str, *, root: Path | None = None, nvcc: str | None = None,
          locked: Callable[[Path], contextlib.AbstractContextManager] = _locked) -> Path:
    """The library of ``source`` for ``arch`` in the build cache, built now if it is not there yet.

    ``locked(folder)`` serializes builders (the compiler side passes
    kvgen.atomic.locked: the same flock, with its own error type); the
    library is written with :func:`.atomic_io.write_atomic` (mode 0o777 less
    the umask, as a linker's output).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc (the CUDA compiler) was not found on PATH or in /usr/local/cuda/bin; install the "
                             "CUDA toolkit, or compile the plan with --backend triton")
    path = library_path(source, arch, nvcc_version(nvcc), root)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CudaBuildError(f"cannot create the CUDA build cache {path.parent}: {exc.strerror}; "
                             "set KVGEN_CACHE_DIR to a writable folder") from None
    with locked(path.parent):
        if not path.is_file():  # another process may have built it while we waited
            write_atomic(path, compile_source(source, arch, nvcc), mode=0o777)
    return path


def find_built(source: str, arch: str, root: Path | None = None) -> Path | None:
    """A library of ``source`` for ``arch`` built by any nvcc version (newest first), for loading without nvcc."""
    folder = (root if root is not None else cache_dir()) / "cuda"
    found = sorted(folder.glob(f"{source_key(source)}-{arch}-nvcc*.so"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


_LOADED: dict[tuple[str, str, str], ctypes._CFuncPtr] = {}
_LOCK = threading.Lock()
_SOURCES: dict[str, str] = {}


def _device_arch(device) -> str:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return arch_for_capability(*torch.cuda.get_device_capability(index))


def load_function(source_path: str | os.PathLike, device, symbol: str, argtypes: list, abi_version: int):
    """The C function ``symbol`` of the library built from the source file, for ``device``'s arch.

    Cached per process (source file, arch, symbol): after the first call this
    is a dictionary lookup. The function returns an int (0 = success).
    """
    source_path = os.fspath(source_path)
    arch = _device_arch(device)
    key = (source_path, arch, symbol)
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        if source_path not in _SOURCES:
            try:
                _SOURCES[source_path] = Path(source_path).read_text(encoding="utf-8")
            except OSError as exc:
                raise CudaBuildError(f"the CUDA source {source_path} of this package cannot be read "
                                     f"({exc.strerror}); recompile the plan") from None
        source = _SOURCES[source_path]
        nvcc = find_nvcc()
        path = build(source, arch, nvcc=nvcc) if nvcc else find_built(source, arch)
        if path is None:
            raise CudaBuildError(f"no CUDA library for {Path(source_path).name} ({arch}) is built and nvcc is not "
                                 "installed; install the CUDA toolkit, or run kvgen compile --backend cuda on this "
                                 "machine first, or compile the plan with --backend triton")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise CudaBuildError(f"cannot load the CUDA kernel library {path}: {exc}; delete it to rebuild") from None
        abi = lib.kvgen_abi_version
        abi.restype = ctypes.c_int
        if abi() != abi_version:
            raise CudaBuildError(f"{path} has kernel ABI {abi()}, the package expects {abi_version}; recompile the plan")
        fn = getattr(lib, symbol)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        err = lib.kvgen_error_string
        err.argtypes, err.restype = [ctypes.c_int], ctypes.c_char_p
        _LOADED[key] = fn
        _ERRORS[source_path] = err
        return fn


_ERRORS: dict[str, ctypes._CFuncPtr] = {}


def launch_error(source_path: str | os.PathLike, code: int) -> CudaBuildError:
    """The error to raise for a nonzero return of a kernel library's launch function."""
    name = Path(source_path).name
    if code == -1:
        return CudaBuildError(f"{name}: this library was not built for the requested num_warps and depth")
    err = _ERRORS.get(os.fspath(source_path))
    what = err(code).decode(errors="replace") if err else f"CUDA error {code}"
    return CudaBuildError(f"{name}: kernel launch failed: {what}")
