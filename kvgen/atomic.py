"""Atomic writes: one file (:func:`write_atomic`) or one whole folder (:func:`replace_folder`).

This is kvgen's one helper for writing things other processes may read at
the same time. It imports nothing heavy (the CLI uses it) and nothing from
kvgen but the error type and the runtime's standard-library file helper.

Files
    :func:`write_atomic` (defined in :mod:`kvgen.runtime.atomic_io`, so the
    runtime shares it) writes a temporary sibling, then ``os.replace``: a
    reader sees the old bytes or the new ones, never a mix. New files get the
    usual ``0o666 & ~umask`` permissions (``tempfile.mkstemp`` would give 0600).

Folders
    :func:`replace_folder` builds the new folder as a hidden sibling
    ``.NAME.kvgen-new-<hex>`` and swaps it in with one system call:

    * Linux (``renameat2(RENAME_EXCHANGE)``, ext4/xfs/btrfs/tmpfs...) and
      macOS (``renamex_np(RENAME_SWAP)``): ``DEST`` is exchanged with the new
      folder atomically. At every instant ``DEST`` is a complete folder from
      one writer; a kill at any point leaves either the old or the new folder
      at ``DEST``, never none.
    * Elsewhere (or a file system that refuses the exchange) the old folder
      is renamed aside and the new one renamed in: two renames, so for an
      instant ``DEST`` is absent, and a kill in that instant leaves no folder
      (compile again to restore it).

    A new or empty ``DEST`` is a single ``rename`` everywhere. The folder that
    was swapped out is deleted right after the swap: a reader that opened the
    old folder (a directory descriptor) and still reads from it may then find
    files missing, and should re-open ``DEST`` (a reader that sees
    ``os.stat(DEST).st_ino`` differ from its descriptor's knows it was
    replaced). Left-overs of killed writers (``.NAME.kvgen-new-*``,
    ``.NAME.kvgen-old-*``) are removed by the next writer of ``DEST``.

    Writers of one parent folder are serialized by an ``flock`` on the parent
    folder itself, so no lock file is created or left behind (where ``flock``
    is unavailable, a ``.kvgen.lock`` file in the parent, through
    ``filelock``). Waiting for the lock times out with an :class:`OutputError`.

Every failure a user can cause (a read-only or missing parent, a busy mount
point, a folder kvgen may not replace, a lock held too long) raises
:class:`OutputError` with a one-line message.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from kvgen.errors import KvgenError
from kvgen.runtime.atomic_io import LockTimeout, folder_lock
from kvgen.runtime.atomic_io import write_atomic  # noqa: F401  (re-exported: kvgen's one atomic-write helper)

LOCK_TIMEOUT_S = 60.0
_STALE = r"\.{name}\.kvgen-(?:new|old)-[0-9a-f]{{12}}"


class OutputError(KvgenError):
    """An output path kvgen cannot or may not write (read-only, busy, not kvgen's, locked too long)."""


def _describe(exc: OSError) -> str:
    if exc.errno == errno.EBUSY:
        return "it is busy (a mount point, or in use by another program)"
    return exc.strerror or str(exc)


@contextlib.contextmanager
def locked(directory: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the writers' lock of ``directory`` (an existing folder); :class:`OutputError` after ``timeout`` s.

    The ``flock`` on the folder itself is :func:`kvgen.runtime.atomic_io.folder_lock` (the runtime's CUDA
    build cache takes the same lock); where folders cannot be locked, a ``.kvgen.lock`` file through filelock.
    """
    directory = Path(directory)
    stack = contextlib.ExitStack()
    try:
        held = stack.enter_context(folder_lock(directory, timeout))
    except LockTimeout:
        raise OutputError(f"another kvgen process has been writing in {directory} for over {timeout:g} s; "
                          "wait for it to finish, or stop it, and try again") from None
    except OSError as exc:
        raise OutputError(f"cannot open {directory} to lock it: {_describe(exc)}") from None
    with stack:
        if held:
            yield
        else:
            yield from _file_locked(directory, timeout)


def _file_locked(directory: Path, timeout: float) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock = FileLock(str(directory / ".kvgen.lock"), timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise OutputError(f"could not lock {directory / '.kvgen.lock'} within {timeout:g} s (another kvgen process, "
                          "or a folder where no file can be created); check the path and try again") from None
    try:
        yield
    finally:
        lock.release()


@functools.cache
def _swap_function() -> Callable[[bytes, bytes], int] | None:
    """The C function that atomically exchanges two paths, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") if sys.platform == "darwin" else None, use_errno=True)
    except OSError:
        return None
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        fn = libc.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_exchange = -100, 2
        return lambda a, b: fn(at_fdcwd, a, at_fdcwd, b, rename_exchange)
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        fn = libc.renamex_np
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rename_swap = 2
        return lambda a, b: fn(a, b, rename_swap)
    return None


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Atomically swap the paths ``a`` and ``b`` (both must exist); False where the platform cannot."""
    fn = _swap_function()
    if fn is None:
        return False
    if fn(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # this file system does not support the exchange
    raise OSError(err, os.strerror(err), os.fspath(b))


def _sibling(dest: Path, kind: str) -> Path:
    return dest.with_name(f".{dest.name}.kvgen-{kind}-{secrets.token_hex(6)}")


def _remove_stale(dest: Path) -> None:
    """Delete what killed writers of ``dest`` left behind (only names this module makes)."""
    pattern = re.compile(_STALE.format(name=re.escape(dest.name)))
    with contextlib.suppress(OSError):
        for entry in os.scandir(dest.parent):
            if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def remove_leftovers(dest: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> None:
    """Delete what killed writers of ``dest`` left behind, if anything (for callers that write nothing)."""
    dest = Path(os.path.abspath(dest))
    pattern = re.compile(_STALE.format(name=re.escape(dest.name)))
    try:
        found = any(pattern.fullmatch(name) for name in os.listdir(dest.parent))
    except OSError:
        return
    if found:
        with locked(dest.parent, timeout):
            _remove_stale(dest)


def _swap_in(staging: Path, dest: Path) -> Path | None:
    """Put ``staging`` at ``dest``; return the path now holding the old folder (to delete), if any."""
    if not os.path.lexists(dest):
        os.rename(staging, dest)
        return None
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        with contextlib.suppress(OSError):
            os.rename(staging, dest)  # POSIX: a folder renames onto an empty one atomically
            return None
    if exchange(staging, dest):
        return staging
    old = _sibling(dest, "old")
    os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(old, dest)  # put the old folder back rather than leave none
        raise
    return old


def replace_folder(dest: str | os.PathLike, files: Mapping[str, bytes | str], *,
                   check: Callable[[Path], None] | None = None, timeout: float = LOCK_TIMEOUT_S) -> Path:
    """Make ``dest`` a folder holding exactly ``files`` (relative POSIX path -> content), atomically.

    ``check(dest)`` runs before anything is written and again under the
    lock; it raises (an :class:`OutputError`) if ``dest`` may not be
    replaced, and nothing is touched. Without ``check`` only an absent or
    empty ``dest`` is replaced. Folders and files get the usual permissions
    (``0o777``/``0o666`` less the umask). Returns ``dest`` made absolute.
    See the module docstring for what readers and killed writers see.
    """
    dest = Path(os.path.abspath(dest))
    if not dest.name or dest.name in (".", ".."):
        raise OutputError(f"cannot write a package folder at {dest}; name a folder inside it")
    check = check or refuse_unless_empty
    for rel in files:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"file path {rel!r} must be relative and stay inside the folder")
    check(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {dest.parent}: {_describe(exc)}; choose a writable output path") from None
    if not dest.parent.is_dir():
        raise OutputError(f"{dest.parent} is not a folder; choose an output path inside a folder")
    with locked(dest.parent, timeout):
        _remove_stale(dest)
        check(dest)
        staging = _sibling(dest, "new")
        old = None
        try:
            os.mkdir(staging, 0o777)
            for rel, data in sorted(files.items()):
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data.encode() if isinstance(data, str) else data)
            old = _swap_in(staging, dest)
        except OSError as exc:
            raise OutputError(f"cannot write {dest}: {_describe(exc)}; choose a writable output path") from None
        finally:
            for leftover in (staging, old):
                if leftover is not None and os.path.lexists(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
    return dest


def refuse_unless_empty(dest: Path) -> None:
    """The default ``check`` of :func:`replace_folder`: only an absent or empty folder may be replaced."""
    if not os.path.lexists(dest):
        return
    if dest.is_symlink() or not dest.is_dir():
        raise OutputError(f"{dest} exists and is not a folder; choose a new or empty folder")
    if any(dest.iterdir()):
        raise OutputError(f"{dest} is not empty; choose a new or empty folder")
