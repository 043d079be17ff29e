"""Load-time kernel warm-up: compile the kernel variants steps will pick before any request waits.

Triton compiles a kernel the first time it is launched with a new set of
constexprs and launch options, and also per *specialization* of its plain
arguments (an int equal to 1, an int divisible by 16, a pointer aligned to 16
bytes each get their own binary). Without warm-up the first step of a new
shape pays those compiles (about 1-2.5 s on an H200). :func:`warm_up` runs
a short list of :class:`Scenario` steps through the **normal path** --
``add`` / ``fork`` / ``plan_step`` / ``append_kv`` / ``decode`` / ``prefill``
of a private, one-layer scratch :class:`~.cache.KVCache` over the same plan
and kernels -- so every launch argument is derived exactly as in serving and
the compiled binaries land in Triton's in-process (and on-disk) caches.

What the scenarios cover (:func:`scenarios`):

- decode, for each compiled variant (tile, warps, stages) the autotuner can
  return -- its model default over every power-of-two bucket, and every valid
  winner persisted for this kernel -- with one split (the direct kernel), a
  few splits, and 16 splits (Triton specializes counts divisible by 16); a
  split launch is the same kernel with its combine step (the last split of a
  group merges the partials), so these build that variant too;
- prefill (fresh chunk, ``prefill(layer, q, k, v)``), for each compiled
  variant of its default over the buckets and of its persisted winners;
- cache_write with 1, a few, 16 and thousands of tokens per step (the fills),
  page_copy through a fork's copy-on-write, and page_quantize (residual
  schemes) through fills that pass the residual window.

The scratch cache has its own pools, block manager and autotuner (mode
``off``, never timing), so the cache being warmed up is never touched: no
page is held, its block manager and step are as before, and nothing is
written to the autotune cache. On the CPU or under ``TRITON_INTERPRET`` there
is nothing to compile and :func:`warm_up` returns at once (``force=True``
runs it anyway: tests).

Not covered: specializations that depend on how ``step.py`` packs a step's
metadata (the block-table width, and 16-byte alignment of the
``seq_lens``/``num_compressed``/copy/conversion views into one buffer),
beyond the classes these scenarios happen to produce; see the module's
tests and issue 13 item 12.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .autotune import Autotuner, bucket
from .autotune_model import valid_config
from .env import triton_interpret

WARM_BATCH = 4
"""Sequences per warm-up step (a batch of 4 keeps the packed metadata 16-byte aligned, as most batches)."""
SPLIT_COUNTS = (3, 16)
"""Split counts run per decode variant besides 1: a count Triton does not specialize, and one it does (% 16)."""
MAX_BATCH = 1024
"""Largest batch bucket whose model default is collected."""


@dataclass(frozen=True)
class Scenario:
    """One warm-up step: ``batch`` sequences of ``context`` tokens each add ``new_tokens``, running ``op``.

    ``op``: ``"decode"``, ``"prefill"`` or ``"write"`` (append_kv only).
    ``config``: forced on the step's ``op`` (None: the config plan_step picks).
    ``fork``: the last sequence is a fork of the first, so the step copies a
    shared page (page_copy). ``why``: what the scenario is there for.
    """

    op: str
    batch: int
    context: int
    new_tokens: int
    config: dict[str, Any] | None = None
    fork: bool = False
    why: str = ""
    mixed: bool = False
    """The last sequence adds one token instead (a decode row beside chunks: the decode kernel attends it and
    the prefill kernel skips it, a variant of its own)."""


@dataclass
class WarmupReport:
    """What :func:`warm_up` did: ``seconds`` of wall time, the ``scenarios`` run, or why it was ``skipped``."""

    seconds: float = 0.0
    scenarios: list[Scenario] = field(default_factory=list)
    skipped: str | None = None


def _compiled(config: dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in config.items() if k != "num_splits"))


def _pow2_upto(n: int, start: int = 1) -> list[int]:
    out, x = [], start
    while x <= max(start, n):
        out.append(x)
        x *= 2
    return out


def _persisted(cache: Any, op: str, sizes_of, with_sizes: bool = False) -> list[Any]:
    """Valid winners persisted for ``op``'s kernel (what config() would return for tuned buckets);
    ``with_sizes``: as ``(bucket sizes, config)`` pairs."""
    tuner: Autotuner = cache.autotuner
    module = cache.kernels[op]
    if tuner.mode == "off":
        return []
    out = []
    for key, entry in tuner.cached(tuner.identity(module, cache._hashes.get(op))).items():
        if not key.startswith(op + "/"):
            continue
        try:
            sizes = sizes_of(key)
        except ValueError:
            continue
        if valid_config(entry["config"], module, sizes, cache.device):
            out.append((sizes, dict(entry["config"])) if with_sizes else dict(entry["config"]))
    return out


def _context_limit(cache: Any) -> int:
    plan = cache.plan
    for key in ("context", "max_context", "max_positions"):
        if isinstance(plan.get(key), int) and plan[key] > 0:
            return int(plan[key])
    return 1 << 17


def decode_variants(cache: Any) -> list[dict[str, Any]]:
    """Distinct compiled decode variants (configs without ``num_splits``) the autotuner can return."""
    module, tuner = cache.kernels["decode"], cache.autotuner
    seen: dict[tuple, dict[str, Any]] = {}
    for b in _pow2_upto(MAX_BATCH):
        for s in _pow2_upto(bucket(_context_limit(cache)), cache.page_size):
            cfg = tuner.default(module, (b, s), "decode")
            if cfg:
                seen.setdefault(_compiled(cfg), {k: v for k, v in cfg.items() if k != "num_splits"})
    for cfg in _persisted(cache, "decode", Autotuner.shape_of):
        seen.setdefault(_compiled(cfg), {k: v for k, v in cfg.items() if k != "num_splits"})
    return list(seen.values())


def prefill_configs(cache: Any) -> list[dict[str, Any]]:
    """Distinct compiled prefill configs: its default over power-of-two buckets, and persisted winners."""
    return [cfg for cfg, _ in _prefill_configs_and_queries(cache)]


def _prefill_configs_and_queries(cache: Any) -> list[tuple[dict[str, Any], int]]:
    """:func:`prefill_configs`, each with the most query tokens of a bucket it serves."""
    module, tuner = cache.kernels["prefill"], cache.autotuner
    limit = bucket(_context_limit(cache))
    seen: dict[tuple, tuple[dict[str, Any], int]] = {}

    def add(cfg: dict[str, Any], q: int) -> None:
        key = _compiled(cfg)
        seen[key] = (seen[key][0], max(seen[key][1], q)) if key in seen else (dict(cfg), q)
    for b in _pow2_upto(MAX_BATCH):
        for q in _pow2_upto(limit):
            for s in _pow2_upto(limit, q):
                cfg = tuner.default(module, (b, q, s), "prefill")
                if cfg:
                    add(cfg, q)
    for sizes, cfg in _persisted(cache, "prefill", Autotuner.shape_of, with_sizes=True):
        add(cfg, int(sizes[1]))
    return list(seen.values())


def scenarios(cache: Any) -> list[Scenario]:
    """The warm-up steps for ``cache``'s plan and kernels (host work only; nothing runs).

    Contexts are chosen so that the block tables are a few pages wide but
    not a multiple of 16 pages, as most steps' are (Triton specializes that
    stride), and the fills cover cache_write's classes: a few tokens, more
    than 4096 rows in two-token programs, counts divisible by 16 and not.
    """
    P = cache.page_size
    max_splits = int(getattr(cache.kernels["decode"], "MAX_SPLITS", 1))
    variants = decode_variants(cache)
    out: list[Scenario] = []
    for v in variants:
        tile = int(v.get("pages_per_tile", 1)) * P
        out.append(Scenario("decode", WARM_BATCH, 2 * P + P // 2, 1, dict(v, num_splits=1), fork=True,
                            why="decode direct (one split); cache_write of a few tokens; page_copy of a fork"))
        for n in SPLIT_COUNTS:
            if n <= max_splits:
                # at least n tiles per sequence, so the launch keeps n splits (it caps them at the tiles)
                out.append(Scenario("decode", WARM_BATCH, n * tile + (1 if n % 2 else 0), 1, dict(v, num_splits=n),
                                    why=f"decode with {n} splits (the variant that combines splits); a long fill"))
    first = dict(variants[0], num_splits=1) if variants else None
    out.append(Scenario("decode", 1, P, 1, first, why="a one-token step (Triton specializes the count 1)"))
    out.append(Scenario("decode", 16, P, 1, first, why="a 16-token step (Triton specializes counts % 16)"))
    # cache_write configs (e.g. tokens per program) that neither the fills nor the steps above use:
    # one write of that many tokens, and one more (Triton specializes counts divisible by 16)
    cw = getattr(cache.kernels.get("cache_write"), "default_config", None)
    if cw is not None:
        seen = {(json.dumps(cw(n), sort_keys=True), n % 16 == 0) for s in out
                for n in (s.batch * s.context, s.batch * s.new_tokens) if n}
        for n in _pow2_upto(1 << 16, 16):
            key = json.dumps(cw(n), sort_keys=True)
            for count in (n, n + 1):
                if (key, count % 16 == 0) not in seen and json.dumps(cw(count), sort_keys=True) == key:
                    seen.add((key, count % 16 == 0))
                    out.append(Scenario("write", 1, 0, count, why="cache_write of many tokens (its own config)"))
    if "prefill" in cache.kernels:
        # staged 2 picks per step between the in-place kernel and staging + the staged kernel, and stages
        # only some sequences of a step (a chunk beside decode rows: both kernels, the in-place one
        # skipping the staged sequences): warm all three (an in-place twin may be a default listed already)
        # (staged variants only for configs of buckets whose chunks can stage: one query block never does)
        module = cache.kernels["prefill"]
        in_place = getattr(module, "in_place_config", lambda c: dict(c, staged=0))  # the tile it runs in place
        refine = getattr(module, "step_config", None)

        def can_stage(cfg: dict[str, Any], q: int) -> bool:
            # q tokens over a prefix of q (staged), or with none (a first chunk: the staged kernel, fresh keys)
            if refine is None or int(cfg.get("staged", 0)) != 2:
                return bool(cfg.get("staged"))
            return any(int(refine(cfg, [q], [n], True).get("staged", 0)) == 1 for n in (2 * q, q))
        # (a config read in place also runs beside a decode row it skips -- mixed -- unless a staging
        # scenario of two sequences already runs its skipping variant)
        forced: list[tuple[int, dict[str, Any], bool]] = []
        for cfg, q in _prefill_configs_and_queries(cache):
            base = in_place(cfg) if cfg.get("staged") else cfg
            if not cfg.get("staged") or not can_stage(cfg, q):
                forced += [(1, base, False), (2, base, True)]
                continue
            forced += [(1, base, False), (1, dict(cfg, staged=1), False),
                       (2, dict(cfg, staged=1, stage_rows=[0]), False)]
        for batch, cfg, mixed in {json.dumps(bc, sort_keys=True): bc for bc in forced}.values():
            why = ("prefill of a chunk beside a decode row (the decode kernel's; the prefill kernel skips it)"
                   if mixed else "prefill of a fresh chunk over a cached prefix" if not cfg.get("staged") else
                   "prefill of a fresh chunk through the staging buffer" if batch == 1 else
                   "prefill staging one sequence of two, the other read in place")
            out.append(Scenario("prefill", batch, P, P, cfg, why=why, mixed=mixed))
    return out


def warm_up(cache: Any, *, force: bool = False, only: Sequence[Scenario] | None = None,
            workers: int | None = None) -> WarmupReport:
    """Run :func:`scenarios` (or ``only``) on scratch copies of ``cache``; returns a :class:`WarmupReport`.

    Skipped (at once) unless ``cache`` is on a CUDA device outside the
    interpreter, or ``force``. Never changes ``cache``: each scratch cache has
    its own pools, block manager and a non-persisting autotuner.

    ``workers`` threads (default 1) each run their share of the scenarios on
    their own scratch cache, so Triton's compiles -- its ptxas runs and
    whatever of its compiler releases the GIL -- overlap. One thread is the
    default until concurrent Triton compiles have been checked on the GPU.
    """
    if not force and (cache.device.type != "cuda" or triton_interpret()):
        return WarmupReport(skipped="no compile to warm up: kernels run on the CPU interpreter")
    start = time.perf_counter()
    todo = list(scenarios(cache) if only is None else only)
    if workers is None:
        workers = 1
    if triton_interpret():  # the interpreter patches triton.language globally: one thread only
        workers = 1
    workers = max(1, min(int(workers), len(todo)))
    shares = [todo[i::workers] for i in range(workers)]
    if workers == 1:
        _run_all(cache, todo)
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(workers, thread_name_prefix="kvgen-warmup") as pool:
            for f in [pool.submit(_run_all, cache, share) for share in shares]:
                f.result()  # re-raises a worker's error
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return WarmupReport(seconds=time.perf_counter() - start, scenarios=todo)


def _run_all(cache: Any, todo: Sequence[Scenario]) -> None:
    if not todo:
        return
    if cache.device.type == "cuda":  # worker threads start on device 0: use the cache's
        torch.cuda.set_device(cache.device)
    tokens = max(s.batch * (s.context + s.new_tokens) for s in todo)
    scratch = type(cache)(cache.plan, cache.kernels, device=cache.device, max_tokens=2 * tokens + 4 * cache.page_size,
                          num_layers=1, autotuner=Autotuner(cache.device, enabled=False, mode="off", progress=False),
                          max_seqs=max(s.batch for s in todo))
    for s in todo:
        _run(scratch, s, torch.Generator(device=cache.device).manual_seed(0))


def _randn(scratch: Any, rows: int, heads: int, gen) -> torch.Tensor:
    # Small values: what the kernels compute on them is thrown away, only the launches matter.
    return 0.1 * torch.randn(rows, heads, scratch.head_dim, device=scratch.device, dtype=scratch.dtype, generator=gen)


def _run(scratch: Any, s: Scenario, gen) -> None:
    ids = [("kvgen-warmup", i) for i in range(s.batch)]
    owners = ids[:-1] if s.fork and s.batch > 1 else ids
    H, HQ = scratch.num_kv_heads, scratch.num_q_heads
    try:
        for sid in owners:
            scratch.add(sid)
        if s.context:
            scratch.plan_step(owners, s.context)
            n = len(owners) * s.context
            scratch.append_kv(0, owners, _randn(scratch, n, H, gen), _randn(scratch, n, H, gen))
        if len(owners) < len(ids):
            scratch.fork(owners[0], ids[-1])
        counts = [s.new_tokens] * s.batch
        if s.mixed:
            counts[-1] = 1
        step = scratch.plan_step(ids, counts)
        if s.config is not None:
            step.configs[s.op] = dict(s.config)
        rows = sum(counts)
        k, v = _randn(scratch, rows, H, gen), _randn(scratch, rows, H, gen)
        if s.op == "write":
            scratch.append_kv(0, ids, k, v)
        elif s.op == "decode":
            scratch.decode(0, _randn(scratch, s.batch, HQ, gen), ids, k, v)
        else:
            scratch.prefill(0, _randn(scratch, rows, HQ, gen), k, v, ids)
    finally:
        for sid in ids:
            if sid in scratch.sequences():
                scratch.free(sid)
        scratch.step = None
