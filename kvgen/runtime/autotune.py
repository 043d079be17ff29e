"""Kernel autotuning with results persisted per kernel, device and Triton version.

Each generated kernel module exposes ``default_config(*shape, device=...)``
and ``candidates(*shape)``. For a shape bucket (every size rounded up to a
power of two) the :class:`Autotuner` times each candidate once, keeps the
fastest and writes it to::

    <cache_dir>/autotune/<kernel hash>__<device slug>__triton-<version>.json
    {"format": 1, "kernel_hash": ..., "device": ..., "triton": ...,
     "entries": {"decode/b8/s1024": {"config": {...}, "ms": 0.031, "candidates": 24}}}

so the file name is the key (kernel hash, device name, Triton version) and a
second process finds the winners without timing anything. Writes are atomic
(temp file + ``os.replace``) under an ``fcntl.flock`` on a sibling lock
file, and merge with whatever another process wrote meanwhile. A file that
does not parse is ignored and rewritten by the next save.

Tuning happens only on a CUDA device with the autotuner enabled; under
``TRITON_INTERPRET=1``, on the CPU, or for a module without ``candidates``
the module's ``default_config`` is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .env import cache_dir, triton_interpret

FORMAT = 1


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): the shape bucket of one dimension."""
    return 1 << max(0, int(n) - 1).bit_length()


def kernel_hash(module: ModuleType, plan_hash: str | None = None) -> str:
    """The KernelSpec hash of a generated module.

    Prefers the hash recorded in plan.json; else recomputes it from the
    module's ``# spec: {...}`` header exactly as ``KernelSpec.hash`` does
    (sha256 of the compact, key-sorted JSON, 16 hex digits); else hashes the
    module's source (hand-written or test modules).
    """
    if plan_hash:
        return str(plan_hash)
    cached = getattr(module, "__kvgen_hash__", None)
    if cached:
        return cached
    source = ""
    path = getattr(module, "__file__", None)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            source = f.read()
    for line in source.splitlines()[:10]:
        if line.startswith("# spec: "):
            spec = json.loads(line[len("# spec: "):])
            canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
            return hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return hashlib.sha256((module.__name__ + "\n" + source).encode()).hexdigest()[:16]


_module_hash = kernel_hash  # Autotuner.config has a parameter of that name


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "-", text).strip("-") or "unknown"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # triton missing: nothing can be tuned anyway
        return "none"


def default_timer(fn: Callable[[], Any]) -> float:
    """Milliseconds per call of ``fn`` (triton.testing.do_bench: warm-up, then the median)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=25))


class _Progress:
    """A plain-text progress bar on stderr (rich is not available in generated packages)."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24) -> None:
        self.label, self.total, self.width = label, max(1, total), width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.best = float("inf")

    def step(self, ms: float) -> None:
        self.done += 1
        self.best = min(self.best, ms)
        filled = self.width * self.done // self.total
        best = f"{self.best:.4f} ms" if self.best < float("inf") else "-"
        self.stream.write(f"\rkvgen autotune {self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} best {best}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


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


class Autotuner:
    """Chooses a config per (kernel, shape bucket); tunes once, remembers on disk.

    ``config(op, module, shape, make_bench, kernel_hash=None)``: ``shape`` is
    the tuple of sizes the module's ``candidates``/``default_config`` take
    (decode: ``(batch, max_seq_len)``; prefill: ``(batch, max_q_len,
    max_seq_len)``), bucketed here; ``make_bench(config)`` returns a
    zero-argument callable that runs the kernel once with that config on
    representative inputs. ``timer(fn) -> ms`` defaults to
    ``triton.testing.do_bench``; ``force=True`` tunes even off-GPU (tests).
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True,
                 directory: str | Path | None = None, timer: Callable[[Callable[[], Any]], float] | None = None,
                 force: bool = False, progress: bool = True, stream=None) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.force = force
        self.directory = Path(directory) if directory is not None else None
        self.timer = timer or default_timer
        self.progress = progress
        self.stream = stream
        self.device_name = device_name(self.device)
        self.triton_version = _triton_version()
        self._entries: dict[str, dict[str, Any]] = {}  # kernel hash -> bucket key -> entry
        self.tuned: list[str] = []  # bucket keys timed by this object (for tests and logs)

    # -- where -----------------------------------------------------------
    def root(self) -> Path:
        return (self.directory if self.directory is not None else cache_dir()) / "autotune"

    def path(self, khash: str) -> Path:
        return self.root() / f"{khash}__{_slug(self.device_name)}__triton-{_slug(self.triton_version)}.json"

    def should_tune(self) -> bool:
        if not self.enabled:
            return False
        if self.force:
            return True
        return self.device.type == "cuda" and not triton_interpret()

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
                if isinstance(e, dict) and isinstance(e.get("config"), dict)}

    def _save(self, khash: str, key: str, entry: dict[str, Any]) -> None:
        path = self.path(khash)
        with _locked(path.with_name(path.name + ".lock")):
            entries = self._read(khash)  # merge with what other processes wrote
            entries[key] = entry
            data = {"format": FORMAT, "kernel_hash": khash, "device": self.device_name,
                    "triton": self.triton_version, "entries": dict(sorted(entries.items()))}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.write("\n")
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        self._entries[khash] = entries

    def cached(self, khash: str) -> dict[str, Any]:
        if khash not in self._entries:
            self._entries[khash] = self._read(khash)
        return self._entries[khash]

    # -- choosing ------------------------------------------------------------
    @staticmethod
    def key(op: str, shape: tuple[int, ...]) -> str:
        names = {"decode": ("b", "s"), "prefill": ("b", "q", "s")}.get(op, ())
        parts = [f"{names[i] if i < len(names) else 'x'}{bucket(n)}" for i, n in enumerate(shape)]
        return "/".join([op, *parts])

    def default(self, module: ModuleType, shape: tuple[int, ...]) -> dict[str, Any] | None:
        fn = getattr(module, "default_config", None)
        if fn is None:
            return None
        return dict(fn(*[bucket(n) for n in shape], device=self.device))

    def config(self, op: str, module: ModuleType, shape: tuple[int, ...],
               make_bench: Callable[[dict[str, Any]], Callable[[], Any]] | None = None,
               kernel_hash: str | None = None) -> dict[str, Any] | None:
        """The config to launch ``module`` with at ``shape``: tuned, remembered, or the default."""
        khash = _module_hash(module, kernel_hash)
        key = self.key(op, shape)
        entry = self.cached(khash).get(key)
        if entry is not None:
            return dict(entry["config"])
        if not self.should_tune() or make_bench is None or not hasattr(module, "candidates"):
            return self.default(module, shape)
        return self._tune(op, module, shape, make_bench, khash, key)

    def _tune(self, op, module, shape, make_bench, khash, key) -> dict[str, Any] | None:
        sizes = [bucket(n) for n in shape]
        cands = [dict(c) for c in module.candidates(*sizes)]
        default = self.default(module, shape)
        if default is not None and default not in cands:
            cands.insert(0, default)
        if not cands:
            return default
        bar = _Progress(f"{key} ({khash[:8]})", len(cands), self.stream) if self.progress else None
        best, best_ms = None, float("inf")
        start = time.perf_counter()
        for cfg in cands:
            try:
                ms = float(self.timer(make_bench(cfg)))
            except Exception:  # a config the device cannot run (registers, shared memory): skip it
                ms = float("inf")
            if ms < best_ms:
                best, best_ms = cfg, ms
            if bar is not None:
                bar.step(ms)
        if best is None:
            return default
        self.tuned.append(key)
        self._save(khash, key, {"config": best, "ms": best_ms, "candidates": len(cands),
                                "seconds": round(time.perf_counter() - start, 3)})
        return dict(best)
