"""/metrics: the server's Prometheus metrics (prometheus_client, one registry per server).

Counted on the engine thread after every step (prometheus_client's values
are thread-safe); the gauges are refreshed there at most every
``GAUGE_INTERVAL_S`` and, through the worker, right before each scrape:

- ``kvgen_requests_running`` / ``kvgen_requests_waiting``: engine requests
  with a sequence in the batch / only in the queue;
- ``kvgen_kv_pages_used`` / ``kvgen_kv_pages_free``: the BlockManager's
  page counts (all pools; evictable prefix-cache pages count as free);
- ``kvgen_prefix_cache_hit_rate``: prompt tokens found in the prefix cache
  over prompt tokens, since start (counters ``kvgen_prompt_tokens_total``,
  ``kvgen_prefix_cache_hit_tokens_total``);
- ``kvgen_generation_tokens_per_second``: output tokens per second over the
  last ``WINDOW_S`` seconds (counter ``kvgen_generation_tokens_total``);
- histograms ``kvgen_time_to_first_token_seconds`` (arrival at the server to
  the first output token) and ``kvgen_time_per_output_token_seconds`` (per
  finished completion with at least two tokens);
- ``kvgen_request_finished_total{reason}`` (stop, length, abort) and
  ``kvgen_http_responses_total{status}``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

WINDOW_S = 10.0
GAUGE_INTERVAL_S = 0.25
"""The engine thread refreshes the gauges at most this often (a scrape refreshes them first anyway)."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """The server's metrics in their own registry (two servers in one process do not collide)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvgen_requests_running", "Requests with a sequence in the running batch", registry=r)
        self.waiting = Gauge("kvgen_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.pages_used = Gauge("kvgen_kv_pages_used", "KV-cache pages in use", registry=r)
        self.pages_free = Gauge("kvgen_kv_pages_free", "KV-cache pages free (evictable cached pages included)",
                                registry=r)
        self.hit_rate = Gauge("kvgen_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt "
                                                             "tokens, since start", registry=r)
        self.tokens_per_s = Gauge("kvgen_generation_tokens_per_second",
                                  f"Output tokens per second over the last {WINDOW_S:g} s", registry=r)
        self.prompt_tokens = Counter("kvgen_prompt_tokens", "Prompt tokens of scheduled requests", registry=r)
        self.hit_tokens = Counter("kvgen_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  registry=r)
        self.gen_tokens = Counter("kvgen_generation_tokens", "Output tokens generated", registry=r)
        self.ttft = Histogram("kvgen_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvgen_time_per_output_token_seconds", "Per completion: (finish - first token) / "
                                                                     "(tokens - 1)", buckets=TPOT_BUCKETS, registry=r)
        self.finished_total = Counter("kvgen_request_finished", "Finished completions by reason", ["reason"],
                                      registry=r)
        self.http = Counter("kvgen_http_responses", "HTTP responses by status", ["status"], registry=r)
        # request id -> [tokens so far, {completion index: tokens so far}] (engine thread)
        self._seen: dict[str, list] = {}
        self._next_refresh = 0.0
        self._window: deque[tuple[float, float]] = deque()
        self._total_gen = 0
        self._total_prompt = 0
        self._total_hit = 0

    # -- engine thread ----------------------------------------------------------------------
    def after_step(self, engine: Any, outs: list[Any], snapshot: bool = False) -> None:
        """Count the step's outputs (engine deltas; with ``snapshot``, full outputs); refresh the gauges now and then.

        Runs on the engine thread after every step, so it costs O(outputs)
        with no locks per output: the gauges (running, waiting, pages,
        tokens/s) are refreshed at most every ``GAUGE_INTERVAL_S`` here, and
        by :meth:`refresh` when /metrics is scraped.
        """
        new = 0
        seen_all = self._seen
        for out in outs:
            rid = out.request_id
            seen = seen_all.get(rid)
            if seen is None:
                seen = [0, {}]  # [tokens of all completions, {completion index: tokens}]
            per = seen[1]
            before = seen[0]
            for c in out.outputs:
                had = per.get(c.index, 0)
                n = len(c.token_ids)
                if snapshot:
                    n = max(n, had)
                    per[c.index] = n
                    seen[0] += n - had
                else:
                    per[c.index] = had + n
                    seen[0] += n
            if before == 0 and seen[0]:
                self._first_token(out)
            new += seen[0] - before
            if out.finished:
                self._finished(out, per)
                seen_all.pop(rid, None)
            else:
                seen_all[rid] = seen
        self._total_gen += new
        if new:
            self.gen_tokens.inc(new)
        now = time.perf_counter()
        if now >= self._next_refresh:
            self.refresh(engine, now)

    def refresh(self, engine: Any, now: float | None = None) -> None:
        """Set the gauges from ``engine`` (on the engine thread, or with the engine stopped)."""
        from .worker import kv_pages

        now = time.perf_counter() if now is None else now
        self._next_refresh = now + GAUGE_INTERVAL_S
        self._window.append((now, self._total_gen))
        while len(self._window) > 2 and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()
        t0, n0 = self._window[0]
        self.tokens_per_s.set((self._total_gen - n0) / (now - t0) if now > t0 else 0.0)
        sched = engine.scheduler
        running = {s.request.request_id for s in sched.running}
        self.running.set(len(running))
        self.waiting.set(len({s.request.request_id for s in sched.waiting} - running))
        pages = kv_pages(engine.cache)
        self.pages_used.set(pages["used"])
        self.pages_free.set(pages["free"])

    def _first_token(self, out: Any) -> None:
        ttft = out.metrics.time_to_first_token
        if ttft is not None:
            self.ttft.observe(max(ttft, 0.0))
        self._total_prompt += len(out.prompt_token_ids)
        self._total_hit += out.num_cached_tokens
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.hit_tokens.inc(out.num_cached_tokens)
        self.hit_rate.set(self._total_hit / self._total_prompt if self._total_prompt else 0.0)

    def _finished(self, out: Any, tokens: dict[int, int]) -> None:
        m = out.metrics
        for c in out.outputs:
            self.finished_total.labels(c.finish_reason or "abort").inc()
            n = tokens.get(c.index, 0)
            if c.finish_reason != "abort" and n > 1 and m.first_token_time and m.finished_time:
                self.tpot.observe(max(m.finished_time - m.first_token_time, 0.0) / (n - 1))

    def aborted(self, request_id: str) -> None:
        """A client went away: its request is aborted and no longer counted."""
        self._seen.pop(request_id, None)
        self.finished_total.labels("abort").inc()

    # -- event loop ---------------------------------------------------------------------------
    def response(self, status: int) -> None:
        self.http.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
