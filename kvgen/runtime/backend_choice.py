"""Which kernel runs an op that a package holds in several languages (``kvgen compile --backend auto``).

A package compiled with ``--backend auto`` holds, per op, a Triton module and
(where a CUDA template serves the op) a CUDA one: ``KERNEL_VARIANTS``, the
first variant of each op being Triton's. Its ``load()`` hands them all to
the runtime, and :func:`choose` picks **one module per op** (not per shape:
the engine captures CUDA graphs over ``cache.kernels[op]``):

- each variant's tuned winner (the autotuner's per-bucket config, tuned now
  where it has none) is timed head to head, by the autotuner's own timer on
  the same synthetic inputs, at the op's shapes: the buckets already tuned
  for any of its variants plus the caller's (``kvgen tune``'s shapes; at
  load the plan's context at batch 1 and at its concurrency); the variant
  with the smaller total runs;
- the choice, its totals and shapes are persisted beside the tuned configs
  (an entry ``backend/<op>/<digest>`` of the first variant's autotune file,
  :mod:`.autotune`), the digest naming every variant's identity, so a
  changed kernel, device or Triton re-decides; later loads reuse it
  without timing.

When it times: ``kvgen tune`` (:func:`.autotune.tune`) always decides anew
(``explicit``); ``KVCache.choose_backend`` (``decide``: an engine asked for
``auto``, before it captures graphs) reuses a remembered choice and
otherwise times now, in any mode but ``off`` and with tuning on; at load
only where the autotuner tunes on first use
(``KVGEN_AUTOTUNE=sync`` on a GPU), otherwise a remembered choice is used
and, without one, the first variant (Triton) runs: on the CPU, under
``TRITON_INTERPRET``, with ``autotune=False``, in the default ``cached``
mode until ``kvgen tune`` has run, and always with ``KVGEN_AUTOTUNE=off``.

A variant that cannot run here (a CUDA library that does not build, load or
launch on this device) is skipped with one warning per process and never
fails a load; a decision made without one of the variants is used by this
process but not persisted. A remembered choice of a variant other than the
first is launched once at load, so a library that stopped loading falls back
to the first variant rather than failing the first request. :func:`choose`
never raises.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .autotune import CHOICE_PREFIX, Autotuner, _warn_once, bucket

TIMED_OPS = ("decode", "prefill")
"""Ops whose variants can be timed (the attention ops ``KVCache._bench`` runs); others keep their first variant."""

Bench = Callable[[ModuleType, tuple[int, ...]], Callable[[dict[str, Any] | None], Callable[[], Any]]]
"""``make_bench(module, shape)(config)`` -> a zero-argument call running ``module`` once at ``shape`` (config None:
the module's own default)."""


@dataclass(frozen=True)
class BackendChoice:
    """The variant that runs ``op``: ``backend``, and ``why`` in one line.

    ``origin``: ``"timed"`` (decided now), ``"remembered"`` (persisted by an
    earlier decision), ``"first"`` (not timed: the first variant), or
    ``"fallback"`` (the first variant because the others could not run).
    ``ms``: per variant, its tuned configs' total milliseconds over
    ``shapes`` (bucket keys), where it was timed.
    """

    op: str
    backend: str
    origin: str
    why: str
    ms: Mapping[str, float] = field(default_factory=dict)
    shapes: tuple[str, ...] = ()


def choice_key(op: str, identities: Mapping[str, str]) -> str:
    """The autotune-file key of the choice among these variants (backend -> autotuner identity, in order)."""
    text = json.dumps(list(identities.items()), separators=(",", ":"))
    return f"{CHOICE_PREFIX}{op}/{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _why_not_timed(tuner: Autotuner) -> str:
    if not tuner.can_time():
        return "kernels are not timed here (no CUDA device, or TRITON_INTERPRET)"
    if not tuner.enabled:
        return "tuning is off (autotune=False)"
    return ("no remembered choice, and KVGEN_AUTOTUNE=cached never times at load: run kvgen tune on this GPU "
            "(or set KVGEN_AUTOTUNE=sync) to time the variants")


def choose(tuner: Autotuner, op: str, variants: Mapping[str, tuple[ModuleType, str | None]], make_bench: Bench,
           shapes: Iterable[tuple[int, ...]] = (), *, explicit: bool = False, decide: bool = False,
           release: Callable[[], Any] | None = None) -> BackendChoice:
    """The variant of ``op`` to run, among ``variants`` (backend -> (module, plan kernel hash or None), first =
    default); see the module docstring for when it times and what it persists.

    ``shapes``: shapes to decide at besides the op's tuned buckets.
    ``explicit``: decide anew by timing (``kvgen tune``, benchmarks), else
    reuse a remembered choice and time only where ``tuner.should_tune()``.
    ``decide``: reuse a remembered choice, else time now wherever timing is
    possible and tuning is on, whatever the autotune mode (an engine that
    asked for ``auto`` at start-up: one decision, persisted), at ``shapes``
    only unless ``explicit``.
    ``release()`` runs after each shape is timed (drops its synthetic inputs).
    """
    names = list(variants)
    first = names[0]
    if len(names) == 1:
        return BackendChoice(op, first, "first", f"{first}: the only {op} kernel")
    try:
        if tuner.mode == "off":
            return BackendChoice(op, first, "first", f"{first}: KVGEN_AUTOTUNE=off (no timed or remembered choice)")
        if op not in TIMED_OPS:
            return BackendChoice(op, first, "first", f"{first}: the runtime times only {' and '.join(TIMED_OPS)}")
        ids = {b: tuner.identity(m, h) for b, (m, h) in variants.items()}
        key = choice_key(op, ids)
        if not explicit:
            entry = tuner.cached(ids[first]).get(key)
            if entry is not None and entry.get("backend") in variants:
                return _remembered(tuner, op, variants, make_bench, entry, release)
            if not (tuner.should_tune() or (decide and tuner.enabled and tuner.can_time())):
                return BackendChoice(op, first, "first", f"{first}: {_why_not_timed(tuner)}")
        elif not tuner.can_time() or (decide and not tuner.enabled):  # kvgen tune times even untuned caches
            return BackendChoice(op, first, "first", f"{first}: {_why_not_timed(tuner)}")
        # an engine's start-up decision (decide, not explicit) times only the shapes it names: the buckets a
        # wide kvgen tune of another package left would each be tuned anew for the other variants
        return _decide(tuner, op, variants, make_bench, shapes, key, ids, release, tuned=explicit or not decide)
    except Exception as err:  # choosing must never fail a load: the first variant always exists
        _warn_once(f"<choose {op}>", f"kvgen: choosing the {op} kernel failed ({type(err).__name__}: {err}); "
                   f"the {first} kernel runs")
        return BackendChoice(op, first, "fallback", f"{first}: choosing failed ({type(err).__name__}: {err})")


def _skip(op: str, backend: str, module: ModuleType, err: BaseException | str, first: str) -> str:
    what = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    _warn_once(f"<variant {op} {backend} {getattr(module, '__name__', '?')}>",
               f"kvgen: the {backend} {op} kernel cannot run here ({what}); it is skipped and {first} is "
               f"considered instead")
    return what


def _remembered(tuner, op, variants, make_bench, entry, release) -> BackendChoice:
    names = list(variants)
    backend, first = entry["backend"], names[0]
    ms = {b: float(v) for b, v in (entry.get("ms") or {}).items() if isinstance(v, (int, float))}
    shapes = tuple(str(k) for k in entry.get("shapes") or ())
    totals = ", ".join(f"{b} {v:.4f} ms" for b, v in ms.items())
    why = f"{backend}: remembered from an earlier timing ({totals} over {len(shapes)} shapes)"
    if backend != first:  # a library may have stopped loading since (a new driver, a cleared build cache)
        module = variants[backend][0]
        probe = tuner.shape_of(min(shapes, key=lambda k: tuner.shape_of(k))) if shapes else None
        if probe is not None:
            try:
                make_bench(module, probe)(None)()
                _synchronize(tuner)
            except Exception as err:
                what = _skip(op, backend, module, err, first)
                return BackendChoice(op, first, "fallback", f"{first}: the remembered {backend} kernel fails "
                                     f"here ({what})", ms, shapes)
            finally:
                if release is not None:
                    release()
    return BackendChoice(op, backend, "remembered", why, ms, shapes)


def _synchronize(tuner: Autotuner) -> None:
    # a launch's asynchronous errors surface at the next synchronization: here, not in a request
    if tuner.device.type == "cuda":
        import torch
        torch.cuda.synchronize(tuner.device)


def _shapes(tuner: Autotuner, op: str, ids: Mapping[str, str], given: Iterable[tuple[int, ...]],
            tuned: bool = True):
    """Bucket key -> shape: the given shapes, then (``tuned``) every bucket tuned for any variant, smallest
    first."""
    out: dict[str, tuple[int, ...]] = {}
    for shape in given:
        out.setdefault(tuner.key(op, tuple(shape)), tuple(int(n) for n in shape))
    for ident in ids.values() if tuned else ():
        for key in tuner.cached(ident):
            if key.startswith(op + "/"):
                try:
                    out.setdefault(key, tuner.shape_of(key))
                except ValueError:
                    continue
    return dict(sorted(out.items(), key=lambda kv: tuple(bucket(n) for n in kv[1])))


def _decide(tuner, op, variants, make_bench, given, key, ids, release, tuned=True) -> BackendChoice:
    names, first = list(variants), next(iter(variants))
    shapes = _shapes(tuner, op, ids, given, tuned)
    if not shapes:
        return BackendChoice(op, first, "first", f"{first}: no shape to time {op} at")
    start = time.perf_counter()
    totals = {b: 0.0 for b in names}
    failed: dict[str, str] = {}
    probed: set[str] = set()
    for shape in shapes.values():
        try:
            for b in names:
                if b in failed:
                    continue
                module, khash = variants[b]
                bench = make_bench(module, shape)
                try:
                    if b not in probed:  # its first launch: a library that cannot load fails here, with why
                        bench(None)()
                        _synchronize(tuner)
                        probed.add(b)
                    entry = tuner.tune(op, module, shape, bench, khash)
                    if entry is None:
                        raise RuntimeError(f"no tuning candidate ran at {tuner.key(op, shape)}")
                    fn = bench(dict(entry["config"]))
                    fn()  # outside the timed region, as the tuner times candidates
                    # the faster of two readings: one can fall in a stretch the GPU runs slow (autotune's
                    # CONFIRM_WITHIN), and this sum decides between whole backends
                    totals[b] += min(float(tuner.timer(fn)), float(tuner.timer(fn)))
                except Exception as err:  # this variant cannot run here: the others still compete
                    failed[b] = _skip(op, b, module, err, first)
        finally:
            if release is not None:
                release()
    alive = [b for b in names if b not in failed]
    if not alive:
        return BackendChoice(op, first, "fallback", f"{first}: no {op} kernel could be timed "
                             f"({'; '.join(f'{b}: {w}' for b, w in failed.items())})")
    best = min(alive, key=lambda b: (totals[b], names.index(b)))
    ms = {b: round(totals[b], 6) for b in alive}
    keys = tuple(shapes)
    others = ", ".join(f"{b} {ms[b]:.4f} ms" for b in alive if b != best)
    why = (f"{best}: {ms[best]:.4f} ms against {others or 'nothing'}, its tuned configs summed over "
           f"{len(keys)} shapes ({', '.join(keys)})")
    if failed:
        why += "; skipped (not persisted): " + "; ".join(f"{b}: {w}" for b, w in failed.items())
    else:
        tuner._save(ids[first], key, {"backend": best, "variants": dict(ids), "ms": ms, "shapes": list(keys),
                                      "seconds": round(time.perf_counter() - start, 3)})
    return BackendChoice(op, best, "timed", why, ms, keys)
