"""The workers' shared asyncio side, and EngineWorker: the engine on a thread of the server's process.

A worker is what the app talks to: :meth:`~WorkerBase.submit` (prompts in,
a :class:`~.stream.Stream` out), ``close(stream)``, ``call(fn, *args)``
(``fn(engine, *args)`` between two steps), ``refresh_metrics()``,
``begin_drain(timeout)``, ``start()``, ``stop()`` (returns what the engine
held: :func:`~.stats.engine_summary`), ``alive``, ``error``, ``draining``
and ``info`` (:class:`~.engine_loop.EngineInfo`). Two kinds:

- :class:`EngineWorker` (this module; ``kvgen serve --engine-in-process``,
  and ``build_app(engine)`` for an engine built by the caller): the
  :class:`~.engine_loop.EngineLoop` on a thread of this process. Commands
  go on a queue; each step's outputs come back in one
  ``call_soon_threadsafe``.
- :class:`kvgen.serve.engine_process.ProcessWorker` (``kvgen serve``'s
  default, ``build_app(EngineSpec(...))``): the same loop in a process of
  its own, so the HTTP side and the engine do not share a GIL.

The engine thread and the event loop share the GIL. With CPython's default
5 ms switch interval, a thread coming back from a GIL-free wait (a GPU
sync, a torch op) while the loop is busy waits up to 5 ms for the GIL --
per release, several times a step -- so a loop busy streaming to many
clients stretched every engine step. While a worker runs, the interval is
:data:`SWITCH_INTERVAL_S`, and the heap that existed when it started is
frozen out of the collector's full collections (both undone when the last
worker stops; see :func:`hold_interpreter`).
"""

from __future__ import annotations

import abc
import asyncio
import gc
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .engine_loop import EngineInfo, EngineLoop, engine_info, prepare_engine
from .protocol import ApiError
from .stats import engine_summary
from .stream import Stream

SWITCH_INTERVAL_S = 0.0005
"""sys.setswitchinterval while a worker runs: how long the engine thread waits at most for the GIL."""
STOP_TIMEOUT_S = 30.0
"""How long a worker's stop waits for the engine (thread or process) to finish its step and stop."""

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.005


def hold_interpreter(on: bool) -> None:
    """Count running workers; the first lowers the switch interval and freezes the heap, the last undoes both.

    Freezing (``gc.freeze``, after one full collection): every object that
    exists when serving starts -- the model, torch's and the tokenizer's
    modules, the engine -- moves to the collector's permanent generation.
    Without it, the full collections that the server's steady allocation
    (messages, futures, outputs) triggers now and then traverse that whole
    heap with the GIL held: 100-200 ms in which neither the engine nor the
    event loop runs (seen in the stand-in benchmark at 64 clients). (The
    engine process freezes its own heap once the engine is built; in its
    parent, with no engine thread, the short interval costs nothing.)
    """
    global _switch_users, _switch_saved
    with _switch_lock:
        if on:
            if _switch_users == 0:
                _switch_saved = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch_saved, SWITCH_INTERVAL_S))
                gc.collect()
                gc.freeze()
            _switch_users += 1
        elif _switch_users > 0:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)
                gc.unfreeze()


class WorkerBase(abc.ABC):
    """The event-loop side both workers share: admission (503, 429), request ids, streams, closing.

    ``max_pending``: engine requests (one per prompt) the server holds at
    most, running and waiting; beyond it :meth:`submit` raises ApiError
    429. ``metrics``: a :class:`kvgen.serve.metrics.ServeMetrics` (or None),
    given the engine's counts after every step. Subclasses send the
    commands (``_add``, ``_abort``, ``_command``) and set ``info``.

    Routing lives here, once for both workers: each engine request's id maps
    to its stream, prompt index and prompt token ids from :meth:`submit`
    until its last output arrives (:meth:`_route`) or its handler closes
    the stream; outputs of ids no longer routed (closed meanwhile) go nowhere.
    """

    info: EngineInfo

    def __init__(self, *, max_pending: int, metrics: Any = None) -> None:
        self.max_pending = max_pending
        self.metrics = metrics
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, Stream] = {}  # live streams by id (submitted, not closed yet)
        self._routes: dict[str, tuple[Stream, int, list[int]]] = {}  # request id -> (stream, prompt index, prompt)
        self._pending = 0  # engine requests submitted and not yet closed
        self._ids = itertools.count()
        self._held = False  # this worker counts in hold_interpreter (from start to stop)

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """The engine runs and has not failed."""

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """What the engine failed with, or None."""

    async def submit(self, prompts: Sequence[list[int]], params: Any, arrival: float) -> Stream:
        """Queue one engine request per prompt (token ids) with ``params``; their outputs arrive on the Stream.

        Raises ApiError 503 while draining or after an engine failure, 429
        when ``max_pending`` would be exceeded, 400 for what the engine refuses.
        """
        if self.draining or not self.alive:
            raise ApiError(503, "the server is shutting down" if self.draining else "the engine has failed",
                           type="service_unavailable", headers={"Retry-After": "5"})
        if self._pending + len(prompts) > self.max_pending:
            raise ApiError(429, f"the server already holds {self._pending} requests (limit {self.max_pending}); "
                                f"retry later", type="rate_limit_exceeded", headers={"Retry-After": "1"})
        base = f"r{next(self._ids)}"
        stream = Stream([f"{base}-{i}" for i in range(len(prompts))])
        self._pending += len(prompts)
        self._streams[id(stream)] = stream
        for i, (rid, prompt) in enumerate(zip(stream.request_ids, prompts)):
            self._routes[rid] = (stream, i, prompt)
        try:
            await self._add(stream, prompts, params, arrival)
        except BaseException:
            self.close(stream)
            raise
        return stream

    def close(self, stream: Stream) -> None:
        """The handler is done with ``stream``: abort what is unfinished (client gone, error) and free its slots."""
        if self._streams.pop(id(stream), None) is None:
            return
        self._pending -= len(stream.request_ids)
        unfinished = [r for r in stream.request_ids if r not in stream.finished]
        if unfinished:
            for rid in unfinished:
                self._routes.pop(rid, None)
            self._abort(unfinished)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` where the engine runs, between two steps; its result (or its error).

        For an engine process ``fn`` must be a module-level function of a
        module that process imports, and the arguments and result picklable.
        """
        return await self._command("call", fn, args)

    async def refresh_metrics(self) -> None:
        """Hand the metrics the engine's counts so far and its gauges as of now."""
        stats = await self._command("stats")
        if self.metrics is not None:
            self.metrics.apply(stats)

    def _hold(self, on: bool) -> None:
        """Count this worker in :func:`hold_interpreter` (start) or stop counting it (stop; once, idempotent)."""
        if on != self._held:
            self._held = on
            hold_interpreter(on)

    def _not_running(self) -> ApiError:
        return ApiError(503, "the engine is not running", type="service_unavailable", headers={"Retry-After": "5"})

    def _route(self, request_id: str, finished: bool) -> tuple[Stream, int, list[int]] | None:
        """Where an output of ``request_id`` goes: ``(stream, prompt index, prompt)``, or None (closed meanwhile).

        ``finished``: the request's last output; its route is dropped.
        """
        if finished:
            return self._routes.pop(request_id, None)
        return self._routes.get(request_id)

    def _fail_routes(self, error: BaseException, request_ids: Iterable[str]) -> None:
        """Fail the streams of ``request_ids`` with ``error``; their outputs go nowhere from now on."""
        routes = [self._routes.pop(rid, None) for rid in request_ids]
        self._fail_streams([route[0] for route in routes if route is not None], error)

    def _fail_streams(self, streams: Iterable[Stream], error: BaseException) -> None:
        """End each of ``streams`` (once, if listed more than once) with ``error``."""
        failed: set[int] = set()
        for stream in streams:
            if id(stream) not in failed:
                failed.add(id(stream))
                stream.fail(error)

    def _end_streams(self) -> None:
        """At the end of ``stop``: fail each open stream still waiting for outputs (none will come) with 503.

        A stopping engine gives every request its last output (finish reason
        ``abort``); this ends the streams of an engine that did not (it
        failed, hung past the stop timeout, or its process was killed).
        """
        error = ApiError(503, "the server stopped before this request finished", type="service_unavailable")
        self._fail_streams([s for s in self._streams.values() if not s.ended], error)
        self._routes.clear()  # a step still running (a stuck thread) hands its outputs to nobody

    @abc.abstractmethod
    async def _add(self, stream: Stream, prompts: Sequence[list[int]], params: Any, arrival: float) -> None:
        """Add one engine request per prompt of ``stream`` where the engine runs (ApiError 400 if refused)."""

    @abc.abstractmethod
    async def _command(self, name: str, *args: Any) -> Any:
        """``EngineLoop.<name>(*args)`` where the engine runs, between two steps; its result (or its error)."""

    @abc.abstractmethod
    def _abort(self, request_ids: list[str]) -> None:
        """Abort these engine requests where the engine runs (no reply awaited)."""


class _ThreadPort:
    """The engine thread's :class:`~.engine_loop.Port`: a command queue in, ``call_soon_threadsafe`` out."""

    def __init__(self, worker: "EngineWorker") -> None:
        self.worker = worker
        self.commands: queue.SimpleQueue[Callable[[EngineLoop], None]] = queue.SimpleQueue()
        self.wake = threading.Event()

    def put(self, command: Callable[[EngineLoop], None]) -> None:
        """Queue ``command(loop)``; safe from any thread, not from a signal handler.

        (``wake.set()`` takes the Event's lock, which is not reentrant: a
        handler that interrupted a ``put`` on its own thread would wait for
        itself. See :meth:`EngineWorker.begin_drain`.)
        """
        self.commands.put(command)
        self.wake.set()

    def wait(self, timeout: float) -> None:
        self.wake.wait(timeout)
        self.wake.clear()

    def run_commands(self, loop: EngineLoop) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            command(loop)

    def emit(self, items: list[tuple[str, Any, bool]], stats: dict[str, Any] | None) -> None:
        self.worker.loop.call_soon_threadsafe(self.worker._on_step, items, stats)

    def fail(self, error: BaseException, request_ids: list[str]) -> None:
        if request_ids:
            self.worker.loop.call_soon_threadsafe(self.worker._fail_routes, error, request_ids)


class EngineWorker(WorkerBase):
    """Runs ``engine`` (an :class:`kvgen.engine.LLMEngine`) on a background thread for an asyncio server.

    The engine's own tokenizer object is ``info.tokenizer`` (the Prompter copies it).
    """

    def __init__(self, engine: Any, *, max_pending: int, metrics: Any = None) -> None:
        super().__init__(max_pending=max_pending, metrics=metrics)
        prepare_engine(engine)
        self.engine = engine
        self.info = engine_info(engine)
        self._port = _ThreadPort(self)
        self._engine_loop = EngineLoop(engine, self._port)
        self._thread: threading.Thread | None = None
        self._ended = False
        self._waiting: set[asyncio.Future] = set()  # commands' futures not settled yet

    # -- life cycle (event loop) ----------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="kvgen-engine", daemon=True)
        self._hold(True)
        self._thread.start()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, int] | None:
        """Abort whatever is left, stop the thread and wait for it (at most ``timeout`` s); what the engine holds.

        Each open stream gets its last output (finish reason ``abort``), or
        ApiError 503 if the thread did not stop in time; calls still waiting
        get 503. The wait runs in an executor, not on the event loop (which
        meanwhile hands those last outputs to their streams).
        """
        self._port.put(EngineLoop.stop)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self._thread_ended()  # after the thread's own callbacks (queued before it ended): only what is left
        self._end_streams()
        self._hold(False)
        if self._thread is not None and self._thread.is_alive():
            return None  # still inside a step: reading the engine here would race it (as a dead process's: None)
        return engine_summary(self.engine)

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests from now on; abort the unfinished ones after ``timeout`` seconds.

        Safe to call from a signal handler (uvicorn's runs on the event
        loop's thread): it sets a field and schedules the command's ``put``
        with ``call_soon_threadsafe``, taking no lock the interrupted code
        may hold (as :meth:`_ThreadPort.put` would: submit and close take it).
        """
        if not self.draining:
            self.draining = True
            deadline = time.monotonic() + timeout
            command = lambda loop: loop.drain(deadline)  # noqa: E731
            if self.loop is None:  # not started: no event loop, no submit to interrupt
                self._port.put(command)
            else:
                self.loop.call_soon_threadsafe(self._port.put, command)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and not self._ended and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._engine_loop.error

    # -- requests and calls (event loop) ----------------------------------------------------
    async def _add(self, stream: Stream, prompts: Sequence[list[int]], params: Any, arrival: float) -> None:
        await self._run(lambda loop: loop.add(stream.request_ids, prompts, params, arrival))

    def _abort(self, request_ids: list[str]) -> None:
        self._port.put(lambda loop: loop.abort(request_ids))

    async def _command(self, name: str, *args: Any) -> Any:
        return await self._run(lambda loop: getattr(loop, name)(*args))

    async def _run(self, command: Callable[[EngineLoop], Any]) -> Any:
        if not self.alive:
            raise self._not_running()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run(engine_loop: EngineLoop) -> None:
            try:
                result = command(engine_loop)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        self._waiting.add(fut)
        self._port.put(run)
        try:
            return await fut
        finally:
            self._waiting.discard(fut)

    # -- the engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._engine_loop.run()
        finally:
            try:
                self.loop.call_soon_threadsafe(self._thread_ended)
            except RuntimeError:  # the event loop is closed already: nobody waits
                pass

    def _thread_ended(self) -> None:
        """On the event loop: the commands still queued never run; their callers get 503."""
        self._ended = True
        for fut in self._waiting:
            if not fut.done():
                fut.set_exception(self._not_running())

    def _on_step(self, items: list[tuple[str, Any, bool]], stats: dict[str, Any] | None) -> None:
        """On the event loop: one step's outputs to their streams, its counts to the metrics."""
        for rid, out, finished in items:
            route = self._route(rid, finished)
            if route is not None:
                route[0].push(route[1], out, finished)
        if self.metrics is not None:
            self.metrics.apply(stats)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
