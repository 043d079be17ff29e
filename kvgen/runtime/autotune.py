"""Kernel configs per shape bucket: a model of the kernel by default, tuned winners when there are some.

Each generated kernel module exposes ``default_config(*shape, device=...)``
and ``candidates(*shape)``. For a shape bucket (every size rounded up to a
power of two) :meth:`Autotuner.config` returns, in this order:

1. a winner persisted by an earlier tuning run (this process, another one,
   or ``kvgen tune`` ahead of time) that is still one of the kernel's
   candidates (anything else in the file is ignored and retuned);
2. otherwise the **model** default (:func:`model_config`): for decode the
   split count, tile and warps that the H200 measurements found best,
   derived from the SM count, batch, KV heads and context; for other ops the
   module's own ``default_config``;
3. and, only when asked to (``KVGEN_AUTOTUNE=sync``, or ``force=True`` in
   tests), it times a pruned candidate set right there: at most
   ``max_candidates`` configs ranked by the model, stopping after
   ``budget_s`` seconds.

No timing happens on the request path by default: tune ahead of time with
:func:`tune` (``kvgen tune``). Winners are written to::

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
format, so an upgrade of the templates never reuses a stale winner, and a
package with an older runtime (its own copy) never overwrites a newer
one's file. A file of an earlier format is left alone and not read; the
first lookup that finds one says once that ``kvgen tune`` must run again. Writes are atomic (temp file +
``os.replace``) under an ``fcntl.flock`` on a sibling lock file and merge
with whatever another process wrote meanwhile. A file that does not parse is
ignored and rewritten by the next save. A cache directory that cannot be
written (a file in its place, a read-only home) costs one warning per
directory and process; the winner is still used by this process. Nothing in
here raises into ``plan_step``: a failure while choosing falls back to the
model default.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .atomic_io import write_atomic
from .autotune_model import MAX_CANDIDATES, model_config, ranked_candidates, valid_config
from .kernel_timer import graph_time_ms
from .env import autotune_mode, cache_dir, triton_interpret

FORMAT = 4
"""4: decode timed as the mean of the bucket's length and half of it (``KVCache._bench``), whose winner may
differ from a winner at the length alone. 3: timed on cold inputs (:func:`.kernel_timer.cold_page_tables`), and
the format in the file name. Files of other formats are not read (those before 3 have no ``__f`` suffix): their
warm timings favoured kernels that reuse L2 over ones a model's layer runs faster."""
CHOICE_PREFIX = "backend/"
"""Entries under this prefix hold a backend choice (:mod:`.backend_choice`), not a bucket's winner."""
BUDGET_S = 5.0
"""Seconds of tuning per bucket after which no further candidate is started."""
COMPILE_MARGIN = 2.0
"""A new compiled variant is predicted to take twice the slowest first call so far (H200, 2026-12-01:
predicting 1x, prefill buckets ran to 5.7-7.0 s; 1.5x still let one run to 6.2 s, int4 prefill at a
131072-token context)."""

_WARNED: set[str] = set()  # cache roots already warned about in this process


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): the shape bucket of one dimension."""
    return 1 << max(0, int(n) - 1).bit_length()


def _source(module: ModuleType) -> str:
    path = getattr(module, "__file__", None)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


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
    source = _source(module)
    for line in source.splitlines()[:10]:
        if line.startswith("# spec: "):
            spec = json.loads(line[len("# spec: "):])
            canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
            return hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return hashlib.sha256((module.__name__ + "\n" + source).encode()).hexdigest()[:16]


def template_tag(module: ModuleType) -> str:
    """What the module was rendered from: its ``# template-hash:`` header, else a hash of its source.

    The KernelSpec hash names *what* a kernel computes; the template decides
    *how*, and with it which configs are fastest (or even valid). A module
    with neither header nor file (built in a test) gets ``"src-none"``.
    """
    source = _source(module)
    for line in source.splitlines()[:10]:
        if line.startswith("# template-hash: "):
            return _slug(line[len("# template-hash: "):].strip())[:32]
    if not source:
        return "src-none"
    return "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]


_module_hash = kernel_hash  # Autotuner.config has a parameter of that name


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    return 1


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "-", text).strip("-") or "unknown"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # triton missing: nothing can be tuned anyway
        return "none"


def default_timer(fn: Callable[[], Any]) -> float:
    """Milliseconds per call of ``fn``: GPU time from a CUDA graph of calls (see :mod:`.kernel_timer`)."""
    return graph_time_ms(fn)


class _Progress:
    """A plain-text progress bar on stderr (rich is not available in generated packages)."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24) -> None:
        self.label, self.total, self.width = label, max(1, total), width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.best = float("inf")

    def step(self, ms: float, last: bool = False) -> None:
        self.done += 1
        self.best = min(self.best, ms)
        filled = self.width * self.done // self.total
        best = f"{self.best:.4f} ms" if self.best < float("inf") else "-"
        self.stream.write(f"\rkvgen autotune {self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} best {best}")
        if self.done == self.total or last:
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


def _warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per ``key`` (a cache folder, a failing op) and process: tuning problems never repeat."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class Autotuner:
    """Chooses a config per (kernel, shape bucket): remembered winner, else the model; tunes when asked.

    ``config(op, module, shape, make_bench, kernel_hash=None)``: ``shape`` is
    the tuple of sizes the module's ``candidates``/``default_config`` take
    (decode: ``(batch, max_seq_len)``; prefill: ``(batch, max_q_len,
    max_seq_len)``), bucketed here; ``make_bench(config)`` returns a
    zero-argument callable that runs the kernel once with that config on
    representative inputs. It never raises: whatever goes wrong while
    choosing ends in the model default (and a warning).

    ``mode`` (default: ``KVGEN_AUTOTUNE``, see :mod:`.env`): ``"cached"``
    uses persisted winners and otherwise the model, never timing on the
    request path; ``"sync"`` also tunes a bucket the first time it is seen
    (pruned to ``max_candidates``, at most about ``budget_s`` seconds);
    ``"off"`` ignores persisted winners too. ``enabled=False`` never times on
    the request path. :meth:`tune` times a bucket explicitly (ahead of time).
    ``timer(fn) -> ms`` defaults to :func:`.kernel_timer.graph_time_ms`;
    ``force=True`` tunes on first use even off-GPU (tests). ``clock()`` (wall
    seconds, default ``time.perf_counter``) keeps the budget: tuning never
    starts a candidate when the time spent plus the slowest candidate so far
    (its input creation, compile and timing) would pass ``budget_s``, so one
    bucket stays within about ``budget_s`` seconds.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True,
                 directory: str | Path | None = None, timer: Callable[[Callable[[], Any]], float] | None = None,
                 force: bool = False, progress: bool = True, stream=None, mode: str | None = None,
                 max_candidates: int = MAX_CANDIDATES, budget_s: float = BUDGET_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.force = force
        self.mode = autotune_mode() if mode is None else mode
        if self.mode not in ("off", "cached", "sync"):
            from .errors import KvgenRuntimeError
            raise KvgenRuntimeError(f"autotune mode must be 'off', 'cached' or 'sync', got {self.mode!r}")
        self.directory = Path(directory) if directory is not None else None
        self.timer = timer or default_timer
        self.progress = progress
        self.stream = stream
        self.max_candidates = max(1, int(max_candidates))
        self.budget_s = float(budget_s)
        self.clock = clock
        self.device_name = device_name(self.device)
        self.sms = num_sms(self.device)
        self.triton_version = _triton_version()
        self._entries: dict[str, dict[str, Any]] = {}  # identity -> bucket key -> entry
        self._chosen: dict[tuple[str, str], tuple[dict[str, Any] | None, str]] = {}  # -> (config, origin)
        self._ids: dict[tuple[int, str | None], tuple[ModuleType, str]] = {}
        self.tuned: list[str] = []  # bucket keys timed by this object (for tests and logs)

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

    def identity(self, module: ModuleType, plan_hash: str | None = None) -> str:
        """``<KernelSpec hash>-<template tag>``: what a persisted winner is keyed by (memoized per module)."""
        memo = self._ids.get((id(module), plan_hash))
        if memo is None or memo[0] is not module:
            memo = (module, f"{_module_hash(module, plan_hash)}-{template_tag(module)}")
            self._ids[(id(module), plan_hash)] = memo
        return memo[1]

    def can_time(self) -> bool:
        """Whether timing is possible at all: a CUDA device outside the interpreter, or ``force``."""
        return self.force or (self.device.type == "cuda" and not triton_interpret())

    def should_tune(self) -> bool:
        """Whether :meth:`config` times a bucket it has no winner for (on the request path)."""
        if not self.enabled:
            return False
        return self.force or (self.mode == "sync" and self.can_time())

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
        if khash not in self._entries:
            self._entries[khash] = self._read(khash)
            if not self._entries[khash]:
                self._warn_if_outdated(khash)
        return self._entries[khash]

    # -- choosing ------------------------------------------------------------
    @staticmethod
    def key(op: str, shape: tuple[int, ...]) -> str:
        names = {"decode": ("b", "s"), "prefill": ("b", "q", "s")}.get(op, ())
        parts = [f"{names[i] if i < len(names) else 'x'}{bucket(n)}" for i, n in enumerate(shape)]
        return "/".join([op, *parts])

    @staticmethod
    def shape_of(key: str) -> tuple[int, ...]:
        """The bucket sizes a :meth:`key` names: ``"decode/b8/s1024"`` -> ``(8, 1024)`` (ValueError if not one)."""
        parts = key.split("/")[1:]
        if not parts:
            raise ValueError(f"not a bucket key: {key!r}")
        return tuple(int(part[1:]) for part in parts)

    def default(self, module: ModuleType, shape: tuple[int, ...], op: str = "") -> dict[str, Any] | None:
        """The model's config for the bucket of ``shape`` (on the CPU: the module's own default)."""
        sizes = tuple(bucket(n) for n in shape)
        if self.device.type != "cuda":
            fn = getattr(module, "default_config", None)
            return None if fn is None else dict(fn(*sizes, device=self.device))
        return model_config(op, module, sizes, self.sms, device=self.device)

    def origin(self, op: str, module: ModuleType, shape: tuple[int, ...], kernel_hash: str | None = None) -> str | None:
        """Where the config last chosen for this bucket came from: ``"cache"``, ``"tuned"``, ``"model"``."""
        got = self._chosen.get((self.identity(module, kernel_hash), self.key(op, shape)))
        return None if got is None else got[1]

    def config(self, op: str, module: ModuleType, shape: tuple[int, ...],
               make_bench: Callable[[dict[str, Any]], Callable[[], Any]] | None = None,
               kernel_hash: str | None = None) -> dict[str, Any] | None:
        """The config to launch ``module`` with at ``shape``: remembered, tuned (if asked), or the model's."""
        try:
            khash = self.identity(module, kernel_hash)
            key = self.key(op, shape)
            memo = self._chosen.get((khash, key))
            if memo is not None:
                return None if memo[0] is None else dict(memo[0])
            sizes = tuple(bucket(n) for n in shape)
            chosen, origin = None, "model"
            entry = self.cached(khash).get(key) if self.mode != "off" else None
            if entry is not None and valid_config(entry["config"], module, sizes, self.device):
                chosen, origin = dict(entry["config"]), "cache"
            elif self.should_tune() and make_bench is not None and hasattr(module, "candidates"):
                got = self._tune(op, module, sizes, make_bench, khash, key)
                if got is not None:
                    chosen, origin = got["config"], "tuned"
            if chosen is None:
                chosen = self.default(module, shape, op)
            self._chosen[(khash, key)] = (chosen, origin)
            return None if chosen is None else dict(chosen)
        except Exception as err:  # choosing a config must never break plan_step: the kernel's default is safe
            _warn_once(f"<config {op} {getattr(module, '__name__', '?')}>",
                       f"kvgen autotune: choosing a {op} config failed ({type(err).__name__}: {err}); "
                       f"the kernel's built-in default is used")
            return None

    def tune(self, op: str, module: ModuleType, shape: tuple[int, ...],
             make_bench: Callable[[dict[str, Any]], Callable[[], Any]], kernel_hash: str | None = None,
             *, retune: bool = False) -> dict[str, Any] | None:
        """Time the bucket of ``shape`` now (ahead of time) and persist the winner; returns its entry.

        A valid persisted winner is returned as is unless ``retune``. None
        when nothing could be timed (no CUDA device, every candidate failed).
        """
        if not self.can_time() or not hasattr(module, "candidates"):
            return None
        khash = self.identity(module, kernel_hash)
        key = self.key(op, shape)
        sizes = tuple(bucket(n) for n in shape)
        entry = self.cached(khash).get(key)
        if not retune and entry is not None and valid_config(entry["config"], module, sizes, self.device):
            self._chosen[(khash, key)] = (dict(entry["config"]), "cache")
            return dict(entry)
        got = self._tune(op, module, sizes, make_bench, khash, key)
        if got is not None:
            self._chosen[(khash, key)] = (dict(got["config"]), "tuned")
        return got

    def _tune(self, op, module, sizes, make_bench, khash, key) -> dict[str, Any] | None:
        cands = ranked_candidates(op, module, sizes, self.sms, self.max_candidates)
        if self.device.type != "cuda":  # forced (tests): the module's default leads, as on the CPU
            first = self.default(module, sizes, op)
            if first is not None:
                cands = [first] + [c for c in cands if c != first][:self.max_candidates - 1]
        if not cands:
            return None
        bar = _Progress(f"{key} ({khash[:8]})", len(cands), self.stream) if self.progress else None
        best, best_ms, timed = None, float("inf"), 0
        start = self.clock()
        # Predicted wall seconds of the next candidate: its first call (a compile when it needs a
        # compiled variant not built yet -- any config key but the runtime split count --, else one
        # run) as the slowest such first call so far, plus the slowest timing so far.
        first_new, first_reuse, timing, variants = 0.0, 0.0, 0.0, set()
        for i, cfg in enumerate(cands):
            variant = tuple(sorted((k, v) for k, v in cfg.items() if k != "num_splits"))
            new = variant not in variants
            # x COMPILE_MARGIN for a new variant: compile times differ between variants (a larger
            # tile compiles slower), and a bucket that runs past the budget is what it is there to prevent.
            predicted = (COMPILE_MARGIN * first_new if new else first_reuse) + timing
            # Never start a candidate that would likely end past the budget; the first always runs
            # (a bucket needs a winner).
            if i and self.clock() - start + predicted > self.budget_s:
                if bar is not None:
                    bar.stream.write(f" (budget {self.budget_s:g} s: {len(cands) - i} candidates left untimed)\n")
                break
            t0 = t1 = None
            try:
                fn = make_bench(cfg)  # the bucket's inputs are made once, by the first call: in the budget
                t0 = self.clock()     # but not in the per-candidate prediction
                fn()  # compile (and run) once outside the timed region, so the timer only times
                t1 = self.clock()
                ms = float(self.timer(fn))
            except Exception:  # a config the device cannot run (registers, shared memory): skip it
                ms = float("inf")
            now = self.clock()
            if t0 is not None:
                first = (t1 if t1 is not None else now) - t0
                if new:
                    first_new = max(first_new, first)
                else:
                    first_reuse = max(first_reuse, first)
                if t1 is not None:
                    timing = max(timing, now - t1)
            variants.add(variant)
            timed += 1
            if ms < best_ms:
                best, best_ms = cfg, ms
            if bar is not None:
                bar.step(ms)
        if best is None:
            return None
        self.tuned.append(key)
        entry = {"config": dict(best), "ms": best_ms, "candidates": timed,
                 "seconds": round(self.clock() - start, 3)}
        self._save(khash, key, entry)
        return dict(entry)


def tune(cache: Any, shapes: Iterable[tuple[int, int]], *, ops: Iterable[str] = ("decode", "prefill"),
         prefill_tokens: int | None = None, retune: bool = False) -> list[dict[str, Any]]:
    """Tune a loaded :class:`~.cache.KVCache`'s kernels ahead of time (what ``kvgen tune`` runs).

    ``shapes``: ``(batch, context)`` pairs; decode is tuned at ``(batch,
    context)``, prefill at ``(batch, prefill_tokens or context, context)``.
    Winners are persisted where the cache's autotuner keeps them, so serving
    processes find them without timing. Returns one record per bucket and
    kernel: ``{op, backend, key, config, ms, candidates, seconds}``
    (``config`` None when nothing could be timed). Every variant of an op
    (``kvgen compile --backend auto``) is tuned, then the cache decides anew
    which one runs (``cache.backend_choices``; :mod:`.backend_choice`) and
    persists that too. Needs a CUDA device (outside the interpreter).
    """
    from .errors import KvgenRuntimeError

    tuner = cache.autotuner
    if not tuner.can_time():
        raise KvgenRuntimeError("kvgen tune times kernels on a CUDA GPU; run it on the serving machine "
                                "(not on the CPU or under TRITON_INTERPRET=1)")
    ops = [op for op in ops if op in cache.kernels]
    records, tuned = [], {op: [] for op in ops}
    for batch, context in shapes:
        for op in ops:
            shape = (batch, context) if op == "decode" else (batch, prefill_tokens or context, context)
            tuned[op].append(shape)
            for backend, module in cache.kernel_variants[op].items():
                t0 = time.perf_counter()
                entry = tuner.tune(op, module, shape,
                                   lambda cfg, op=op, shape=shape, m=module: cache._bench(op, shape, cfg, m),
                                   cache._variant_hash(op, backend), retune=retune) or {}
                records.append({"op": op, "backend": backend, "key": tuner.key(op, shape),
                                "config": entry.get("config"), "ms": entry.get("ms"),
                                "candidates": entry.get("candidates"), "seconds": round(time.perf_counter() - t0, 3)})
            vars(cache).pop("_bench_inputs", None)  # the bucket's synthetic inputs (see KVCache._bench)
    for op in ops:
        if len(cache.kernel_variants[op]) > 1:
            cache._choose_backend(op, tuned[op], explicit=True)
    return records
