"""EngineWorker: the one thread that calls the engine, and the asyncio side that talks to it.

The engine (and the BlockManager under it) is not thread-safe, so every
engine call happens on the worker's thread: the HTTP handlers, on the event
loop, only put commands on a queue (``add``, ``abort``, ``call``) and read
results from per-request mailboxes (:class:`Stream`). The thread loops: run
the queued commands, then one ``engine.step()`` if anything is unfinished
(else sleep until a command arrives), then hand the step's outputs to the
event loop in one ``call_soon_threadsafe``; it never waits on the loop. A
command runs between two steps, so an abort frees the request's pages
before the next step is planned.

The engine thread and the event loop share the GIL. With CPython's default
5 ms switch interval, a thread coming back from a GIL-free wait (a GPU
sync, a torch op) while the loop is busy waits up to 5 ms for the GIL --
per release, several times a step -- so a loop busy streaming to many
clients stretched every engine step. While a worker runs, the interval is
:data:`SWITCH_INTERVAL_S`, and the heap that existed when it started is
frozen out of the collector's full collections (both undone when the last
worker stops; see :func:`_hold_switch_interval`).

Draining (SIGTERM): :meth:`begin_drain` refuses new requests; requests
still unfinished at the deadline are aborted (their streams end with finish
reason ``abort``). A failing step aborts every request, delivers the error
to each, and stops the worker (``/health`` then reports it).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .protocol import ApiError

IDLE_WAIT_S = 0.5
SWITCH_INTERVAL_S = 0.0005
"""sys.setswitchinterval while a worker runs: how long the engine thread waits at most for the GIL."""

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.005


def _hold_switch_interval(on: bool) -> None:
    """Count running workers; the first lowers the switch interval and freezes the heap, the last undoes both.

    Freezing (``gc.freeze``, after one full collection): every object that
    exists when serving starts -- the model, torch's and the tokenizer's
    modules, the engine -- moves to the collector's permanent generation.
    Without it, the full collections that the server's steady allocation
    (messages, futures, outputs) triggers now and then traverse that whole
    heap with the GIL held: 100-200 ms in which neither the engine nor the
    event loop runs (seen in the stand-in benchmark at 64 clients).
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


class Stream:
    """The engine requests of one HTTP request (one per prompt) and the mailbox their outputs arrive in.

    Outputs are deltas (the engine's ``output_kind = "delta"``: only the
    token ids, logprobs and text new since the request's last output), so
    the mailbox holds one pending output per prompt and merges each new
    delta into it (ids, logprobs and text appended; ``finished``, finish
    and stop reasons and ``cumulative_logprob`` from the newest): a handler
    that falls behind the engine reads one output covering several steps
    (streamed as one multi-token chunk) instead of a backlog of one item
    per step, and the merging costs O(new tokens) per push. The engine
    thread never waits on the handler: it drops its deltas in with one loop
    callback per step for all streams.
    """

    __slots__ = ("request_ids", "finished", "closed", "_latest", "_pushed", "_error", "_waiter")

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.finished: set[str] = set()  # ids whose last output the handler has taken
        self.closed = False  # the reader gave up (its client went away): next_batch() returns None
        # prompt index -> [pending merged output, finished, {completion index: text pieces}]
        self._latest: dict[int, list] = {}
        # prompt index -> {completion index: [tokens, characters] pushed so far} (to turn a snapshot into a delta)
        self._pushed: dict[int, dict[int, list[int]]] = {}
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    # event loop: called by the worker's per-step callback
    def push(self, index: int, out: Any, finished: bool, snapshot: bool = False) -> None:
        """Merge ``out`` (a delta; with ``snapshot``, a full output, of which only the unpushed rest counts)."""
        pushed = self._pushed.setdefault(index, {})
        if snapshot:
            out = _rest_of(out, pushed)
        for c in out.outputs:
            n = pushed.get(c.index)
            if n is None:
                pushed[c.index] = [len(c.token_ids), len(c.text)]
            else:
                n[0] += len(c.token_ids)
                n[1] += len(c.text)
        pending = self._latest.get(index)
        if pending is None:
            self._latest[index] = [out, finished, None]
        else:
            pending[2] = _merge(pending[0], out, pending[2])
            pending[1] = finished
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def cancel(self) -> None:
        """Stop the reader: a pending or later :meth:`next_batch` returns None (the client went away)."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_batch(self) -> list[tuple[int, Any]] | None:
        """A list of ``(prompt_index, RequestOutput)``: per prompt that changed, its deltas merged into one.

        Waits until there is one; None once every prompt finished or after
        :meth:`cancel`. An engine failure is ApiError 500. (A plain coroutine,
        not an async generator: a streaming handler calls it once per engine
        step, so each call must cost little.)
        """
        while True:
            if self.closed or self.done:
                return None
            if self._error is not None:
                e = self._error
                raise ApiError(500, f"the engine failed: {type(e).__name__}: {e}", type="internal_error")
            if self._latest:
                break
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        latest, self._latest = self._latest, {}
        batch = []
        for index, (out, finished, pieces) in (sorted(latest.items()) if len(latest) > 1 else latest.items()):
            if pieces:
                for c in out.outputs:
                    if c.index in pieces:
                        c.text = "".join(pieces[c.index])
            if finished:
                self.finished.add(self.request_ids[index])
            batch.append((index, out))
        return batch

    async def batches(self):
        """Yield :meth:`next_batch` until it returns None."""
        while (batch := await self.next_batch()) is not None:
            yield batch

    async def outputs(self):
        """Yield ``(prompt_index, RequestOutput)`` until every prompt finished (see :meth:`batches`)."""
        async for batch in self.batches():
            for item in batch:
                yield item


class EngineWorker:
    """Runs ``engine`` (an :class:`kvgen.engine.LLMEngine`) on a background thread for an asyncio server.

    ``max_pending``: requests (engine requests, one per prompt) the server
    holds at most, running and waiting; beyond it :meth:`submit` raises
    ApiError 429. ``metrics``: a :class:`kvgen.serve.metrics.ServeMetrics`
    (or None), updated from the worker thread after every step.
    """

    def __init__(self, engine: Any, *, max_pending: int, metrics: Any = None) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = metrics
        self.error: BaseException | None = None
        self.draining = False
        self._deadline: float | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[str, tuple[Stream, int]] = {}  # worker thread only
        self._streams: set[int] = set()  # live streams (event loop only): ids of Stream objects
        self._pending = 0  # engine requests submitted and not yet closed (event loop only)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._released_switch = False

    # -- life cycle (event loop) ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvgen-engine", daemon=True)
        _hold_switch_interval(True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, stop the thread and wait for it (at most ``timeout`` seconds)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._released_switch:
                self._released_switch = True
                _hold_switch_interval(False)

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests from now on; abort the unfinished ones after ``timeout`` seconds.

        Safe to call from a signal handler (it only sets fields and an event).
        """
        if not self.draining:
            self.draining = True
            self._deadline = time.monotonic() + timeout
            self._wake.set()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # -- requests (event loop) -------------------------------------------------------------
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
        self._streams.add(id(stream))
        try:
            await self.call(lambda: self._add(stream, prompts, params, arrival))
        except BaseException:
            self.close(stream)
            raise
        return stream

    def close(self, stream: Stream) -> None:
        """The handler is done with ``stream``: abort what is unfinished (client gone, error) and free its slots."""
        if id(stream) not in self._streams:
            return
        self._streams.discard(id(stream))
        self._pending -= len(stream.request_ids)
        unfinished = [r for r in stream.request_ids if r not in stream.finished]
        if unfinished:
            self._put(lambda: self._abort(unfinished))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the worker thread between two steps; returns its result (or raises its error)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        if not self.alive:
            raise ApiError(503, "the engine is not running", type="service_unavailable",
                           headers={"Retry-After": "5"})
        self._put(run)
        return await fut

    def _put(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- worker thread ----------------------------------------------------------------------
    def _add(self, stream: Stream, prompts: Sequence[list[int]], params: Any, arrival: float) -> None:
        from kvgen.errors import KvgenError

        added = []
        try:
            for i, (rid, ids) in enumerate(zip(stream.request_ids, prompts)):
                self.engine.add_request(rid, ids, params, arrival_time=arrival)
                self._sinks[rid] = (stream, i)
                added.append(rid)
        except KvgenError as e:
            self._abort(added)
            raise ApiError(400, str(e)) from None
        except BaseException:
            self._abort(added)
            raise

    def _abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self._sinks.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                if self.metrics is not None:
                    self.metrics.aborted(rid)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                self._run_commands()
                if self._stop:
                    self._abort(list(self._sinks))
                    return
                if self._deadline is not None and time.monotonic() >= self._deadline and self._sinks:
                    self._abort_all("the server is shutting down; the drain timeout passed")
                if not eng.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                before = eng.num_steps
                outs = eng.step()
                self._deliver(outs)
                if self.metrics is not None:
                    self.metrics.after_step(eng, outs)
                if eng.num_steps == before and not outs:
                    self._wake.wait(0.01)  # nothing could be scheduled: do not spin
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 -- reported to every request and /health
            traceback.print_exc()
            self.error = e
            self._fail_all(e)

    def _abort_all(self, reason: str) -> None:
        """Abort every request; each stream gets its last output (finish reason ``abort``).

        The outputs are full snapshots (``engine.output_of``): the stream
        keeps only what it had not been pushed yet (the text the engine
        still held back), the metrics count only tokens not counted yet.
        """
        outs = []
        for rid in list(self._sinks):
            req = self.engine.requests.get(rid)
            self.engine.abort_request(rid)
            if req is not None:
                outs.append(self.engine.output_of(req))
        self._deliver(outs, force_finished=True, snapshot=True)
        if self.metrics is not None:
            self.metrics.after_step(self.engine, outs, snapshot=True)

    def _fail_all(self, error: BaseException) -> None:
        items = []
        for rid, (stream, _) in list(self._sinks.items()):
            try:
                self.engine.abort_request(rid)
            except BaseException:  # noqa: BLE001 -- the engine is already broken; the pages die with it
                pass
            items.append((stream, error))
        self._sinks.clear()
        if self._loop is not None and items:
            self._loop.call_soon_threadsafe(_fail_streams, items)

    def _deliver(self, outs: Sequence[Any], force_finished: bool = False, snapshot: bool = False) -> None:
        items = []
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its client already
            stream, index = sink
            finished = out.finished or force_finished
            if finished:
                del self._sinks[out.request_id]
            items.append((stream, index, out, finished, snapshot))
        if items and self._loop is not None:
            self._loop.call_soon_threadsafe(_push_all, items)

    # -- introspection (worker thread, through call()) -------------------------------------
    def kv_pages(self) -> dict[str, int]:
        """Pages of the cache in use and free (all pools together); call on the worker thread."""
        return kv_pages(self.engine.cache)


def kv_pages(cache: Any) -> dict[str, int]:
    """``{"total", "free", "used", "sequences"}`` of ``cache``'s page pools (the BlockManager's counts)."""
    from kvgen.runtime.block_manager import COMPRESSED, RESIDUAL

    bm = cache.block_manager
    total = cache.num_pages + cache.num_residual_pages
    free = bm.num_free_pages(COMPRESSED) + (bm.num_free_pages(RESIDUAL) if cache.num_residual_pages else 0)
    return {"total": total, "free": free, "used": total - free, "sequences": len(cache.sequences())}


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _push_all(items: list[tuple[Stream, int, Any, bool, bool]]) -> None:
    for stream, index, out, finished, snapshot in items:
        stream.push(index, out, finished, snapshot)


def _merge(into: Any, new: Any, pieces: dict[int, list[str]] | None) -> dict[int, list[str]] | None:
    """Append delta ``new`` to the pending output ``into`` (owned by the stream: the engine keeps neither).

    Texts are collected as pieces (joined once when the handler reads) so a
    long backlog does not copy its text again at every push; returns the pieces.
    """
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        p = by_index.get(c.index)
        if p is None:
            into.outputs.append(c)
            continue
        if c.text:
            if pieces is None:
                pieces = {}
            parts = pieces.get(c.index)
            if parts is None:
                pieces[c.index] = [p.text, c.text]
            else:
                parts.append(c.text)
        p.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if p.logprobs is None:
                p.logprobs = list(c.logprobs)
            else:
                p.logprobs.extend(c.logprobs)
        p.cumulative_logprob = c.cumulative_logprob
        p.finish_reason = c.finish_reason
        p.stop_reason = c.stop_reason
    into.finished = new.finished
    return pieces


def _rest_of(out: Any, pushed: dict[int, list[int]]) -> Any:
    """Snapshot ``out`` cut to what was not pushed yet (``pushed``: completion index -> [tokens, characters])."""
    comps = []
    for c in out.outputs:
        tokens, chars = pushed.get(c.index, (0, 0))
        comps.append(replace(c, text=c.text[chars:], token_ids=list(c.token_ids[tokens:]),
                             logprobs=None if c.logprobs is None else list(c.logprobs[tokens:])))
    return replace(out, outputs=comps)


def _fail_streams(items: list[tuple[Stream, BaseException]]) -> None:
    for stream, error in items:
        stream.fail(error)
