"""Where tuned winners are kept: one JSON file per kernel identity, device and Triton version.

:class:`AutotuneStore` is the persistence half of the autotuner
(:class:`.autotune.Autotuner` mixes it in); it neither chooses nor times.
Winners are written to::

    <cache_dir>/autotune/<kernel hash>-<template tag>__<device slug>__triton-<version>__f<FORMAT>.json
    {"format": 4, "kernel_hash": ..., "device": ..., "triton": ...,
     "entries": {"decode/b8/s1024": {"config": {...}, "ms": 0.031, "candidates": 8, "seconds": 2.1},
                 "backend/decode/<digest>": {"backend": "cuda", "variants": {...}, "ms": {...}, "shapes": [...]}}}

A ``backend/<op>/<digest>`` entry (in the file of the op's first variant)
is the runtime's choice among the kernels a ``--backend auto`` package
holds for one op; the digest covers every variant's identity, so a changed
variant re-decides (see :mod:`.backend_choice`).

The file name is the key: the KernelSpec hash, the template hash of the
generated module (its ``# template-hash:`` header; a module without one is
keyed by its source), the device name, the Triton version and the file
format (:mod:`.autotune_keys` makes them), so an upgrade of the templates
never reuses a stale winner, and a package with an older runtime (its own
copy) never overwrites a newer one's file. A file of an earlier format is left alone and not read; the
first lookup that finds one says once that ``kvgen tune`` must run again. Writes are atomic (temp file +
``os.replace``) under an ``fcntl.flock`` on a sibling lock file and merge
with whatever another process wrote meanwhile. A file that does not parse is
ignored and rewritten by the next save. A cache directory that cannot be
written (a file in its place, a read-only home) costs one warning per
directory and process; the winner is still used by this process.
"""

from __future__ import annotations

import contextlib
import glob
import json
import warnings
from pathlib import Path
from typing import Any

from .atomic_io import write_atomic
from .autotune_keys import _slug
from .env import cache_dir

FORMAT = 4
"""4: decode timed as the mean of the bucket's length and half of it (``KVCache._bench``), whose winner may
differ from a winner at the length alone. 3: timed on cold inputs (:func:`.kernel_timer.cold_page_tables`), and
the format in the file name. Files of other formats are not read (those before 3 have no ``__f`` suffix): their
warm timings favoured kernels that reuse L2 over ones a model's layer runs faster."""
CHOICE_PREFIX = "backend/"
"""Entries under this prefix hold a backend choice (:mod:`.backend_choice`), not a bucket's winner."""

_WARNED: set[str] = set()  # cache roots already warned about in this process


@contextlib.contextmanager
def _locked(lock_path: Path):
    import fcntl
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per ``key`` (a cache folder, a failing op) and process: tuning problems never repeat."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class AutotuneStore:
    """The autotune files of one device and Triton version: read once per kernel, merged on every write.

    A mixin: the class using it sets ``directory`` (a folder, or None for
    ``KVGEN_CACHE_DIR``), ``device_name``, ``triton_version``, ``mode``
    (``"off"`` hides persisted entries from :meth:`remembered`) and
    ``_entries`` (an empty dict: identity -> bucket key -> entry, this
    process's copy). ``khash`` everywhere is an autotuner identity
    (``<KernelSpec hash>-<template tag>``). Nothing here raises on an
    unreadable or unwritable cache: a missing or foreign file reads as empty,
    and a failed write is one warning while the entry stays in memory.
    """

    # -- where -----------------------------------------------------------
    def root(self) -> Path:
        return (self.directory if self.directory is not None else cache_dir()) / "autotune"

    def path(self, khash: str) -> Path:
        return self.root() / f"{self._stem(khash)}__f{FORMAT}.json"

    def _stem(self, khash: str) -> str:
        return f"{khash}__{_slug(self.device_name)}__triton-{_slug(self.triton_version)}"

    def _warn_if_outdated(self, khash: str) -> None:
        # another format's file of the same kernel, device and Triton: format 2 and before have no format suffix
        stem = self._stem(khash)
        try:
            outdated = (self.root() / f"{stem}.json").is_file() or any(
                p.name != self.path(khash).name for p in self.root().glob(f"{glob.escape(stem)}__f*.json"))
        except OSError:  # an unreadable cache folder: _read and _save say so where it matters
            return
        if outdated:
            _warn_once(f"<outdated {self.root()}>",
                       f"kvgen autotune: tuned configs under {self.root()} were timed by an earlier kvgen, in a way "
                       f"this one does not use (format {FORMAT} now); run kvgen tune again on this GPU (the old "
                       f"files are left as they are)")

    # -- persistence -------------------------------------------------------
    def _read(self, khash: str) -> dict[str, Any]:
        """The file's entries, or {} when it is missing, unreadable or not ours."""
        try:
            data = json.loads(self.path(khash).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return {}
        if (not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict)
                or data.get("kernel_hash") != khash or data.get("device") != self.device_name
                or data.get("triton") != self.triton_version):
            return {}
        return {k: e for k, e in data["entries"].items()
                if isinstance(e, dict) and (isinstance(e.get("config"), dict) if not k.startswith(CHOICE_PREFIX)
                                            else isinstance(e.get("backend"), str))}

    def _save(self, khash: str, key: str, entry: dict[str, Any]) -> None:
        """Merge ``entry`` into the file; an unwritable cache is a warning (the entry stays in memory)."""
        self.cached(khash)[key] = entry
        path = self.path(khash)
        try:
            with _locked(path.with_name(path.name + ".lock")):
                entries = self._read(khash)  # merge with what other processes wrote
                entries[key] = entry
                data = {"format": FORMAT, "kernel_hash": khash, "device": self.device_name,
                        "triton": self.triton_version, "entries": dict(sorted(entries.items()))}
                write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except OSError as err:
            _warn_once(str(self.root()), f"kvgen autotune: cannot save tuned configs under {self.root()} "
                       f"({type(err).__name__}: {err}); they are kept in memory for this process only. "
                       f"Point KVGEN_CACHE_DIR at a writable folder to keep them.")
            return
        self._entries[khash] = dict(entries)

    def remembered(self, khash: str, key: str) -> dict[str, Any] | None:
        """The persisted entry under ``key`` of the file of ``khash`` (any caller's keys: the engine keeps its
        projection kernels' choices here too), or None: none, or mode ``"off"``."""
        if self.mode == "off":
            return None
        entry = self.cached(khash).get(key)
        return None if entry is None else dict(entry)

    def remember(self, khash: str, key: str, entry: dict[str, Any]) -> None:
        """Persist ``entry`` (a dict whose ``config`` is a dict) under ``key`` in the file of ``khash``: merged
        with what other processes wrote, under the file's lock, written atomically; an unwritable cache is one
        warning, and the entry is kept in memory for this process."""
        if not isinstance(entry.get("config"), dict):
            raise ValueError(f"an autotune entry needs a 'config' dict, got {entry!r}")
        self._save(khash, key, dict(entry))

    def cached(self, khash: str) -> dict[str, Any]:
        """This process's entries of ``khash`` (the live dict), read from its file on first use; when there are
        none, a file of another format is said once (:meth:`_warn_if_outdated`)."""
        if khash not in self._entries:
            self._entries[khash] = self._read(khash)
            if not self._entries[khash]:
                self._warn_if_outdated(khash)
        return self._entries[khash]
