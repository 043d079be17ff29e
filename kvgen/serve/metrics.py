"""/metrics: the server's Prometheus metrics (prometheus_client, one registry per server).

The engine's side (the engine thread, or the engine process) counts each
step's outputs and reads the gauges at most every
:data:`~kvgen.serve.stats.GAUGE_INTERVAL_S` (:class:`kvgen.serve.stats.StepCounter`);
the worker hands those counts to :meth:`ServeMetrics.apply` on the event
loop, and a scrape asks the engine for fresh gauges first. The series:

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
- ``kvgen_request_finished_total{reason}`` (stop, length, abort): engine
  requests (one per prompt, whatever its ``n``), aborted ones however they
  were (client gone, drain, stop) and refused ones not at all; see
  :func:`kvgen.serve.stats.request_reason`; and
  ``kvgen_http_responses_total{status}``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

WINDOW_S = 10.0
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
        self.finished_total = Counter("kvgen_request_finished", "Finished requests (one per prompt) by reason",
                                      ["reason"], registry=r)
        self.http = Counter("kvgen_http_responses", "HTTP responses by status", ["status"], registry=r)
        self._window: deque[tuple[float, float]] = deque()
        self._total_gen = 0
        self._total_prompt = 0
        self._total_hit = 0

    def apply(self, stats: dict[str, Any] | None) -> None:
        """Add one hand-over of :meth:`kvgen.serve.stats.StepCounter.take` (None: nothing new)."""
        if stats is None:
            return
        new = stats["tokens"]
        if new:
            self._total_gen += new
            self.gen_tokens.inc(new)
        if stats["prompt"]:
            self._total_prompt += stats["prompt"]
            self._total_hit += stats["hit"]
            self.prompt_tokens.inc(stats["prompt"])
            self.hit_tokens.inc(stats["hit"])
            self.hit_rate.set(self._total_hit / self._total_prompt)
        for x in stats["ttft"]:
            self.ttft.observe(x)
        for x in stats["tpot"]:
            self.tpot.observe(x)
        for reason, n in stats["finished"].items():
            self.finished_total.labels(reason).inc(n)
        gauges = stats["gauges"]
        if gauges is not None:
            self._set_gauges(gauges)

    def _set_gauges(self, g: dict[str, int]) -> None:
        now = time.perf_counter()
        self._window.append((now, self._total_gen))
        while len(self._window) > 2 and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()
        t0, n0 = self._window[0]
        self.tokens_per_s.set((self._total_gen - n0) / (now - t0) if now > t0 else 0.0)
        self.running.set(g["running"])
        self.waiting.set(g["waiting"])
        self.pages_used.set(g["pages_used"])
        self.pages_free.set(g["pages_free"])

    # -- event loop ---------------------------------------------------------------------------
    def response(self, status: int) -> None:
        self.http.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
