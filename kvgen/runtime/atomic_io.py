"""kvgen's one atomic-write helper and folder lock, in the runtime so the runtime can use them too.

The runtime imports nothing from the rest of kvgen, so the helper lives
here; :mod:`kvgen.atomic` (the compiler side: folders, one-line
``OutputError`` messages) and :mod:`kvgen.plugin_api` (plugins) re-export
:func:`write_atomic` and build their locks on :func:`folder_lock`. Standard
library only.

:func:`write_atomic` writes a temporary sibling (a random name, so threads
and processes never share one), then ``os.replace``: a reader sees the old
bytes or the new ones, never a mix, and a failed write leaves no temporary
file. :func:`folder_lock` is an exclusive ``flock`` on a folder itself, so
no lock file is created or left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path


class LockTimeout(Exception):
    """Another process held a :func:`folder_lock` for longer than the timeout (callers turn it into their error)."""


def write_atomic(path: str | os.PathLike, data: bytes | str, *, encoding: str = "utf-8", mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and ``os.replace`` (never half-written).

    Missing parent folders are created. The file gets ``mode`` less the umask
    (``tempfile.mkstemp`` would give 0600); pass ``0o777`` for an executable
    or a shared library. OSErrors propagate unchanged: the caller knows
    whether an unwritable path is the user's mistake or a cache that may fail
    quietly.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode(encoding)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def folder_lock(directory: str | os.PathLike, timeout: float) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the folder ``directory`` itself; yields whether a lock is held.

    Yields False where folders cannot be ``flock``-ed (no ``fcntl``, or a
    file system without ``flock`` on folders): the caller takes another lock
    or none. Raises :class:`LockTimeout` after ``timeout`` seconds of
    waiting, and ``OSError`` if the folder cannot be opened. The lock is
    released when the block ends (closing the descriptor releases it).
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        yield _flock(fcntl, fd, directory, timeout)
    finally:
        os.close(fd)


def _flock(fcntl, fd: int, directory: str | os.PathLike, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # a file system without flock on folders (some network ones)
            return False
        if time.monotonic() >= deadline:
            raise LockTimeout(f"{directory} was locked by another process for over {timeout:g} s")
        time.sleep(0.05)
