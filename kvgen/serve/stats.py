"""What the server's metrics need from the engine, read where the engine runs, as plain data (no prometheus).

The engine runs on the engine thread or in the engine process; the
Prometheus registry lives with the HTTP side. So the engine's side counts
each step's outputs here (:class:`StepCounter`) and hands over a small
dict per step (:meth:`StepCounter.take`), which
:meth:`kvgen.serve.metrics.ServeMetrics.apply` turns into samples. The
dict, when anything happened since the last one::

    {"tokens": int,                 # output tokens generated
     "prompt": int, "hit": int,     # prompt tokens of requests that got their first token, and of those cached
     "ttft": [s, ...],              # arrival -> first token, per request that got its first token
     "tpot": [s, ...],              # per finished completion with >= 2 tokens: (finish - first) / (tokens - 1)
     "finished": {reason: count},   # finished engine requests (one per prompt) by reason: see request_reason
     "gauges": None or {"running", "waiting", "pages_used", "pages_free"}}

Times are the engine's ``time.perf_counter()`` stamps against the arrival
stamp the HTTP side passed in; perf_counter is the system-wide monotonic
clock on Linux and macOS, so the difference holds across processes.
"""

from __future__ import annotations

import time
from typing import Any

GAUGE_INTERVAL_S = 0.25
"""The gauges are read from the engine at most this often after steps (a /metrics scrape reads them first anyway)."""


def kv_pages(cache: Any) -> dict[str, int]:
    """``{"total", "free", "used", "sequences"}`` of ``cache``'s page pools (the BlockManager's counts)."""
    from kvgen.runtime.block_manager import COMPRESSED, RESIDUAL

    bm = cache.block_manager
    total = cache.num_pages + cache.num_residual_pages
    free = bm.num_free_pages(COMPRESSED) + (bm.num_free_pages(RESIDUAL) if cache.num_residual_pages else 0)
    return {"total": total, "free": free, "used": total - free, "sequences": len(cache.sequences())}


def engine_gauges(engine: Any) -> dict[str, int]:
    """``{"running", "waiting", "pages_used", "pages_free"}``: engine requests in the batch / only queued, and pages."""
    sched = engine.scheduler
    running = {s.request.request_id for s in sched.running}
    waiting = {s.request.request_id for s in sched.waiting} - running
    pages = kv_pages(engine.cache)
    return {"running": len(running), "waiting": len(waiting), "pages_used": pages["used"],
            "pages_free": pages["free"]}


def engine_summary(engine: Any) -> dict[str, int]:
    """What ``engine`` still holds: ``{"requests", "pages_used", "pages_total", "sequences"}`` (at shutdown)."""
    pages = kv_pages(engine.cache)
    return {"requests": engine.num_unfinished_requests(), "pages_used": pages["used"], "pages_total": pages["total"],
            "sequences": pages["sequences"]}


def request_reason(out: Any) -> str:
    """What ended a finished engine request, counted once per request whatever its ``n``.

    ``abort`` if any completion was aborted (client gone, drain, stop),
    else ``length`` if any hit its length limit, else ``stop``.
    """
    reasons = {c.finish_reason for c in out.outputs}
    if "abort" in reasons or None in reasons:
        return "abort"
    return "length" if "length" in reasons else "stop"


class StepCounter:
    """Counts the engine's outputs step by step where the engine runs; :meth:`take` hands the counts over.

    O(outputs) per step with no locks. Outputs are engine deltas (an
    abort's too: see :meth:`kvgen.serve.engine_loop.EngineLoop.drain`).
    """

    def __init__(self) -> None:
        # request id -> [tokens of all completions, {completion index: tokens}]
        self._seen: dict[str, list] = {}
        self._next_gauges = 0.0
        self._reset()

    def _reset(self) -> None:
        self._tokens = 0
        self._prompt = 0
        self._hit = 0
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._finished: dict[str, int] = {}

    def count(self, outs: list[Any]) -> None:
        """Count one step's outputs."""
        new = 0
        seen_all = self._seen
        for out in outs:
            rid = out.request_id
            seen = seen_all.get(rid)
            if seen is None:
                seen = [0, {}]
            per = seen[1]
            before = seen[0]
            for c in out.outputs:
                n = len(c.token_ids)
                per[c.index] = per.get(c.index, 0) + n
                seen[0] += n
            if before == 0 and seen[0]:
                self._first_token(out)
            new += seen[0] - before
            if out.finished:
                self._finish(out, per)
                seen_all.pop(rid, None)
            else:
                seen_all[rid] = seen
        self._tokens += new

    def aborted(self, request_id: str) -> None:
        """A client went away: its request was aborted (one ``abort``) and is no longer counted."""
        self._seen.pop(request_id, None)
        self._finished["abort"] = self._finished.get("abort", 0) + 1

    def forget(self, request_id: str) -> None:
        """The request was taken back before it ran (its HTTP request was refused): it counts nowhere."""
        self._seen.pop(request_id, None)

    def take(self, engine: Any, gauges: bool = False) -> dict[str, Any] | None:
        """The counts since the last take (see the module), with the gauges when due or asked; None if nothing."""
        now = time.perf_counter()
        read = gauges or now >= self._next_gauges
        if not read and not (self._tokens or self._finished or self._prompt):
            return None
        stats = {"tokens": self._tokens, "prompt": self._prompt, "hit": self._hit, "ttft": self._ttft,
                 "tpot": self._tpot, "finished": self._finished, "gauges": None}
        if read:
            self._next_gauges = now + GAUGE_INTERVAL_S
            stats["gauges"] = engine_gauges(engine)
        self._reset()
        return stats

    def _first_token(self, out: Any) -> None:
        ttft = out.metrics.time_to_first_token
        if ttft is not None:
            self._ttft.append(max(ttft, 0.0))
        self._prompt += len(out.prompt_token_ids)
        self._hit += out.num_cached_tokens

    def _finish(self, out: Any, tokens: dict[int, int]) -> None:
        m = out.metrics
        fin = self._finished
        reason = request_reason(out)
        fin[reason] = fin.get(reason, 0) + 1
        for c in out.outputs:
            n = tokens.get(c.index, 0)
            if c.finish_reason != "abort" and n > 1 and m.first_token_time and m.finished_time:
                self._tpot.append(max(m.finished_time - m.first_token_time, 0.0) / (n - 1))
