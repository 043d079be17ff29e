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
:func:`tune` (``kvgen tune``). Where winners are written, in which format and
under which lock is :mod:`.autotune_store`'s job (:class:`Autotuner` mixes
in its :class:`~.autotune_store.AutotuneStore`); what they are keyed by,
:mod:`.autotune_keys`'. The names other code imports from those two are
re-exported here. Nothing in here raises into ``plan_step``: a failure
while choosing falls back to the model default.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .autotune_keys import _triton_version, bucket, device_name, kernel_hash, num_sms, template_tag
from .autotune_model import MAX_CANDIDATES, model_config, ranked_candidates, valid_config
from .autotune_store import CHOICE_PREFIX, FORMAT, _WARNED, AutotuneStore, _warn_once  # noqa: F401  (re-exported)
from .kernel_timer import graph_time_ms
from .env import autotune_mode, triton_interpret

BUDGET_S = 5.0
"""Seconds of tuning per bucket after which no further candidate is started."""
COMPILE_MARGIN = 2.0
"""A new compiled variant is predicted to take twice the slowest first call so far (H200, 2026-12-01:
predicting 1x, prefill buckets ran to 5.7-7.0 s; 1.5x still let one run to 6.2 s, int4 prefill at a
131072-token context)."""

CONFIRM_WITHIN = 0.20
"""After each candidate was timed once, those within this fraction of the fastest are timed again (at most
``CONFIRM_MAX``: the runners-up first, nearest first, as only they can take the lead, then the fastest, whose own
reading is what the backend choice compares) and keep the faster of their two readings. One reading can fall in a
stretch the GPU runs about 15% slow at unchanged clocks (H100, 2026-12-05,
benchmarks/results/2026-12-05-nvidia-h100-4): read once, the CUDA bf16 kernel lost the backend choice to a slower
Triton one at 4 of 6 anchors, and CUDA int8 to Triton at 1.3x its time at D=64."""
CONFIRM_MAX = 3


def confirm_front_runners(readings: list, time_again: Callable[[Any], float],
                          may_start: Callable[[], bool] = lambda: True) -> None:
    """Times the front-runners of ``readings`` (``[config, ms, bench]`` lists, one reading each) again, in place:
    those within ``CONFIRM_WITHIN`` of the fastest, at most ``CONFIRM_MAX``, the runners-up first (nearest first)
    and the fastest last, while ``may_start()``; each keeps the faster of its two readings (the first where
    ``time_again(bench)`` raises)."""
    if not readings:
        return
    fastest = min(r[1] for r in readings)
    front = sorted((r for r in readings if r[1] <= fastest * (1 + CONFIRM_WITHIN)), key=lambda r: r[1])
    for r in front[1:CONFIRM_MAX] + front[:1]:
        if not may_start():
            break
        try:
            r[1] = min(r[1], time_again(r[2]))
        except Exception:  # it ran once already; a second failure leaves its first reading
            pass


_module_hash = kernel_hash  # Autotuner.config has a parameter of that name


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


class Autotuner(AutotuneStore):
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
        readings = []  # [config, ms, bench] of each candidate that ran
        timed = 0
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
            if ms < float("inf"):
                readings.append([cfg, ms, fn])
            if bar is not None:
                bar.step(ms)
        if not readings:
            return None
        # as for candidates: no confirmation ends past the budget
        confirm_front_runners(readings, lambda fn: float(self.timer(fn)),
                              may_start=lambda: self.clock() - start + timing <= self.budget_s)
        best, best_ms, _ = min(readings, key=lambda r: r[1])
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
