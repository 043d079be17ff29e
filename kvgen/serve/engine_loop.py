"""EngineLoop: the server's step loop around an engine, the same on the engine thread and in the engine process.

The engine (and the BlockManager under it) is not thread-safe, so one
thread owns it: :class:`kvgen.serve.worker.EngineWorker`'s thread, or the
main thread of the engine process (:mod:`kvgen.serve.engine_process`).
Either runs :meth:`EngineLoop.run`: run the queued commands (``add``,
``abort``, ``call``, ``stats``, ``drain``, ``stop``), then one
``engine.step()`` if anything is unfinished (else wait until a command
arrives), then hand the step's outputs and the metrics' counts (see
:mod:`.stats`) over in one piece; it never waits on the HTTP side. A
command runs between two steps, so an abort frees the request's pages
before the next step is planned.

How commands arrive and outputs leave is the :class:`Port`'s business: a
queue and ``call_soon_threadsafe`` for the thread, a socket for the
process. Each output goes out with its request id; the worker on the
HTTP side routes it to its stream (:class:`kvgen.serve.worker.WorkerBase`).

Draining (SIGTERM): after :meth:`EngineLoop.drain` requests still
unfinished at the deadline are aborted; each gets its last delta (what it
had not been sent, finish reason ``abort``: ``engine.delta_of``).
:meth:`EngineLoop.stop` ends the loop after aborting what is left the same
way (so every open stream ends). A failing step
aborts every request, hands the error to the port for each
(``Port.fail``) and ends the loop (``error`` is set).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .protocol import ApiError
from .stats import StepCounter

IDLE_WAIT_S = 0.5
"""With nothing to run, the loop waits this long at most for a command (and then checks the drain deadline)."""
BUSY_WAIT_S = 0.01
"""A step that could schedule nothing (no pages free): wait this long for a command rather than spin."""


def prepare_engine(engine: Any) -> None:
    """Set ``engine`` up as the server runs it: delta outputs, with the running text.

    Deltas: each step hands over only its new tokens and text (a snapshot
    would copy every request's whole output each step); the Stream merges
    them for a handler that fell behind.
    """
    engine.stream_text = True
    engine.output_kind = "delta"


@dataclass
class EngineInfo:
    """What the HTTP side needs of the engine: its tokenizer (or None), vocabulary size and context limit."""

    tokenizer: Any
    vocab_size: int | None
    max_model_len: int


def engine_info(engine: Any) -> EngineInfo:
    return EngineInfo(engine.tokenizer, getattr(engine, "vocab_size", None), engine.max_model_len)


class Port(Protocol):
    """How an :class:`EngineLoop` gets its commands and hands over its outputs (called on the loop's thread)."""

    def wait(self, timeout: float) -> None:
        """Block until a command may have arrived, or ``timeout`` seconds."""

    def run_commands(self, loop: "EngineLoop") -> None:
        """Run the commands that arrived (each calls a method of ``loop``), without blocking."""

    def emit(self, items: list[tuple[str, Any, bool]], stats: dict[str, Any] | None) -> None:
        """Hand over ``(request id, delta output, finished)`` per output and the metrics' counts."""

    def fail(self, error: BaseException, request_ids: list[str]) -> None:
        """The engine failed with ``error``: end these requests."""


class EngineLoop:
    """Drives ``engine`` for the server through ``port``; every method runs on the loop's own thread."""

    def __init__(self, engine: Any, port: Port, counter: StepCounter | None = None) -> None:
        self.engine = engine
        self.port = port
        self.counter = counter or StepCounter()
        self.error: BaseException | None = None
        self.sinks: set[str] = set()  # ids of the requests whose outputs still go somewhere
        self.deadline: float | None = None
        self.stopping = False

    # -- commands (run by the port between steps) -----------------------------------------
    def add(self, request_ids: Sequence[str], prompts: Sequence[list[int]], params: Any, arrival: float) -> None:
        """Add one engine request per prompt; ApiError 400 (and none added) for what the engine refuses."""
        from kvgen.errors import KvgenError

        added = []
        try:
            for rid, ids in zip(request_ids, prompts):
                self.engine.add_request(rid, ids, params, arrival_time=arrival)
                self.sinks.add(rid)
                added.append(rid)
        except KvgenError as e:
            self._take_back(added)
            raise ApiError(400, str(e)) from None
        except BaseException:
            self._take_back(added)
            raise

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort the requests (their clients went away: one ``abort`` each); their pages are free when this returns."""
        for rid in request_ids:
            if rid in self.sinks:
                self.sinks.discard(rid)
                self.engine.abort_request(rid)
                self.counter.aborted(rid)

    def _take_back(self, request_ids: Sequence[str]) -> None:
        """Remove the requests of a refused add (its HTTP request got 400): not aborts, counted nowhere."""
        for rid in request_ids:
            if rid in self.sinks:
                self.sinks.discard(rid)
                self.engine.abort_request(rid)
                self.counter.forget(rid)

    def call(self, fn: Callable[..., Any], args: Sequence[Any] = ()) -> Any:
        """``fn(engine, *args)``, between two steps."""
        return fn(self.engine, *args)

    def stats(self) -> dict[str, Any]:
        """The metrics' counts so far, with the gauges read now (for a /metrics scrape)."""
        return self.counter.take(self.engine, gauges=True)

    def drain(self, deadline: float) -> None:
        """Abort what is still unfinished at ``deadline`` (a ``time.monotonic()`` value; the first call sets it).

        The server computes the deadline when the signal arrives, not this
        loop when it reads the command (between two steps, one step later):
        the drain timeout counts from SIGTERM. (CLOCK_MONOTONIC is one clock
        for every process of the machine, the engine process included.)
        """
        if self.deadline is None:
            self.deadline = deadline

    def stop(self) -> None:
        """End :meth:`run` before the next step, aborting what is left (each request's last output says so)."""
        self.stopping = True

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop` (or a failure: then ``error`` is set and every request got it)."""
        eng = self.engine
        port = self.port
        try:
            while True:
                port.run_commands(self)
                if self.stopping:
                    self._abort_all()
                    return
                if self.deadline is not None and time.monotonic() >= self.deadline and self.sinks:
                    self._abort_all()
                if not eng.has_unfinished_requests():
                    self._hand_over([])  # counts of aborts made by commands, gauges when due
                    port.wait(IDLE_WAIT_S)
                    continue
                before = eng.num_steps
                outs = eng.step()
                self._hand_over(outs)
                if eng.num_steps == before and not outs:
                    port.wait(BUSY_WAIT_S)  # nothing could be scheduled: do not spin
        except BaseException as e:  # noqa: BLE001 -- reported to every request and /health
            traceback.print_exc()
            self.error = e
            self._fail_all(e)

    def _abort_all(self) -> None:
        """Abort every request; each gets its last delta (the rest it was not sent, finish reason ``abort``)."""
        eng = self.engine
        outs = []
        for rid in list(self.sinks):
            req = eng.requests.get(rid)
            eng.abort_request(rid)
            if req is not None:
                outs.append(eng.delta_of(req))
        self._hand_over(outs, force_finished=True)

    def _fail_all(self, error: BaseException) -> None:
        request_ids = list(self.sinks)
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except BaseException:  # noqa: BLE001 -- the engine is already broken; the pages die with it
                pass
        self.sinks.clear()
        self.port.fail(error, request_ids)

    def _hand_over(self, outs: Sequence[Any], force_finished: bool = False) -> None:
        items = []
        sinks = self.sinks
        for out in outs:
            rid = out.request_id
            if rid not in sinks:
                continue  # aborted by its client already
            finished = out.finished or force_finished
            if finished:
                sinks.discard(rid)
            items.append((rid, out, finished))
        if outs:
            self.counter.count(outs)
        stats = self.counter.take(self.engine)
        if items or stats is not None:
            self.port.emit(items, stats)
