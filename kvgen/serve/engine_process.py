"""ProcessWorker: the engine in a process of its own (``kvgen serve``'s default), driven from the event loop.

With the engine on a thread of the server's process, the HTTP side and
the engine's step loop share one GIL: every streamed chunk is Python work
the engine waits behind (on the H200 the served throughput at 64 clients
was 14-30% below the engine's own, 60% at 256). As vLLM V1 does, the
engine core runs in its own process instead:

- :class:`EngineSpec` says how to build the engine (a module-level factory
  and its keyword arguments; for ``kvgen serve``,
  :func:`kvgen.engine.loader.build_engine` with the command line's). The
  engine process is started with multiprocessing's ``spawn`` (CUDA-safe),
  builds the engine itself and runs :class:`~.engine_loop.EngineLoop` --
  the loop the in-process thread runs -- see :mod:`.engine_child`.
- The two talk over a socket pair (:mod:`.channel`): commands in (``add``,
  ``abort``, ``call``, ``stats``, ``drain``, ``stop``), one message per
  engine step out (its delta outputs and the metrics' counts). On this
  side no thread: the event loop reads the socket (an asyncio protocol)
  and pushes each step's outputs to their :class:`~.stream.Stream`.
- The HTTP side needs the tokenizer, the vocabulary size and
  ``max_model_len`` for its Prompter: the engine process sends them once
  the engine is built, the tokenizer as the pickled object itself (a
  Hugging Face tokenizer pickles; a GGUF's would have to be re-read from
  the file, and an EngineSpec need not name a model path at all), so both
  sides tokenize with the same tokenizer whatever built it.
- Death of the engine process (a crash, a kill) is noticed at once (end of
  file on the socket; the process's sentinel as a backstop): ``alive``
  turns False, every open stream fails with ApiError 500, ``/health``
  answers 503. The engine process exits when this process dies (it reads
  end of file; a thread watches for a parent that dies while the engine
  still loads), and an exit hook here kills it if this interpreter exits
  without :meth:`ProcessWorker.stop`.
- Stopping: :meth:`~ProcessWorker.begin_drain` forwards the drain (the
  loop aborts what is unfinished at the deadline); :meth:`~ProcessWorker.stop`
  sends ``stop``, takes the engine's summary (requests left, pages used,
  sequences) from the engine process's last message and waits for it to exit.

The construction blocks until the engine is built (or raises its error:
a user's mistake -- a KvgenError, or the runtime's KvgenRuntimeError -- so
that ``kvgen serve`` prints one line (kvgen's own classes as they are, a
generated package's copy as an EngineProcessError, see
:func:`~.channel.portable_error`); an EngineProcessError after
``EngineSpec.start_timeout``).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .channel import (BadFrame, EngineProcessError, FrameReader, ParentProtocol, command_frame, decode_output,
                      load_payload, socket_pair)
from .engine_child import child_main
from .stream import Stream
from .worker import STOP_TIMEOUT_S, WorkerBase

START_TIMEOUT_S = 1800.0
"""How long the engine process may take to build the engine by default (a large model's weights from a slow disk)."""
EXIT_TIMEOUT_S = 15.0
"""After its ``stopped`` message, how long the engine process may take to exit (closing tp ranks) before a kill."""


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its engine: ``factory(**kwargs)``; picklable.

    ``factory``: a module-level function (pickled by name), or its name as
    ``"package.module:function"`` (imported in the engine process only: the
    server's process then never imports what the factory needs; ``kvgen
    serve`` itself still imports torch there once, to ask whether a GPU exists).
    As with any ``spawn`` start, the engine process imports the main
    script again (as ``__mp_main__``): a script that serves an EngineSpec
    keeps its top-level code under ``if __name__ == "__main__":``.
    ``start_timeout``: seconds the engine process may take to start and
    build the engine; then it is killed and EngineProcessError raised.
    """

    factory: Callable[..., Any] | str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    start_timeout: float = START_TIMEOUT_S

    def build(self) -> Any:
        factory = self.factory
        if isinstance(factory, str):
            module, _, name = factory.partition(":")
            factory = getattr(importlib.import_module(module), name)
        return factory(**self.kwargs)


class ProcessWorker(WorkerBase):
    """The app's worker for an engine in its own process (see the module); same interface as EngineWorker."""

    def __init__(self, spec: EngineSpec, *, max_pending: int, metrics: Any = None) -> None:
        super().__init__(max_pending=max_pending, metrics=metrics)
        self.spec = spec
        self._error: BaseException | None = None
        self._replies: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._transport: asyncio.Transport | None = None
        self._stopped: asyncio.Future | None = None
        self._summary: dict[str, int] | None = None
        self._gone = False  # the engine process exited (or its socket closed)
        self._stopping = False
        self._reaping: asyncio.Future | None = None
        self._launch()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # -- start-up (blocking, before the event loop runs) ---------------------------------------
    def _launch(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._sock, child_sock = socket_pair()
        self._proc = ctx.Process(target=child_main, args=(self.spec, child_sock), name="kvgen-engine")
        try:
            self._proc.start()
        except Exception as e:  # noqa: BLE001 -- most likely a spec that does not pickle
            self._sock.close()
            raise EngineProcessError(f"cannot start the engine process: {type(e).__name__}: {e} (an EngineSpec's "
                                     f"factory must be a module-level function and its kwargs picklable)") from e
        finally:
            child_sock.close()
        atexit.register(self._kill)
        self._reader = FrameReader()
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            raise

    def _wait_ready(self) -> Any:
        """Read until ``ready`` (the EngineInfo); the engine's own error if building it failed, or timed out."""
        sock, proc = self._sock, self._proc
        timeout = self.spec.start_timeout
        deadline = time.monotonic() + timeout
        while True:
            ready = multiprocessing.connection.wait([sock, proc.sentinel], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise EngineProcessError(f"the engine process did not build the engine within {timeout:g} s "
                                         f"(EngineSpec.start_timeout); it was stopped")
            if sock in ready:
                data = sock.recv(1 << 20)
                messages = self._reader.feed(data) if data else []
                for message in messages:
                    if isinstance(message, BadFrame):
                        raise EngineProcessError(
                            f"the engine process's first message (the engine's tokenizer, or its error) cannot be "
                            f"unpickled in the server process ({type(message.error).__qualname__}: "
                            f"{message.error}); serve with --engine-in-process")
                    kind, value = message
                    if kind == "ready":
                        return value
                    if kind == "error":
                        proc.join(EXIT_TIMEOUT_S)
                        raise value
                if data:
                    continue
            proc.join(EXIT_TIMEOUT_S)
            raise EngineProcessError(f"the engine process exited with code {proc.exitcode} while building the "
                                     f"engine (its error is printed above)")

    # -- life cycle (event loop) ----------------------------------------------------------
    async def start(self) -> None:
        """Read and write the engine process's socket from the running event loop from now on."""
        self.loop = loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._sock.setblocking(False)
        protocol = ParentProtocol(self._reader, self._on_message, self._on_lost)
        self._transport, _ = await loop.create_unix_connection(lambda: protocol, sock=self._sock)
        loop.add_reader(self._proc.sentinel, self._on_exit)
        self._hold(True)

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, int] | None:
        """Stop the engine process and wait for it (off the event loop); its summary (None if it had died).

        The engine aborts what is left, each open stream getting its last
        output (finish reason ``abort``). An engine process that has not
        stopped after ``timeout`` seconds (stuck in a step or a call) is
        killed; then its open streams get ApiError 503 and calls still
        waiting get 503.
        """
        self._stopping = True
        if self._transport is None:  # never started: nothing ran on it
            self._kill()
            return None
        if not self._gone:
            self._send(None, "stop", ())
            try:
                await asyncio.wait_for(asyncio.shield(self._stopped), timeout)
            except asyncio.TimeoutError:
                self._proc.kill()  # no grace left to give it
        await self._start_reaping()
        self._child_gone()  # (if its end of file is not read yet) the replies still awaited will not come
        self._end_streams()
        self.loop.remove_reader(self._proc.sentinel)
        self._transport.close()
        self._hold(False)
        return self._summary

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests from now on; the engine aborts the unfinished ones after ``timeout`` seconds.

        Safe to call from a signal handler (the command is sent from the event loop).
        """
        if not self.draining:
            self.draining = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._send, None, "drain", (time.monotonic() + timeout,))

    @property
    def alive(self) -> bool:
        return not self._gone and self._error is None and self._transport is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- requests and calls (event loop) ----------------------------------------------------
    async def _add(self, stream: Stream, prompts: Sequence[list[int]], params: Any, arrival: float) -> None:
        await self._command("add", stream.request_ids, prompts, params, arrival)

    def _abort(self, request_ids: list[str]) -> None:
        if self.alive:
            self._send(None, "abort", (request_ids,))

    async def _command(self, name: str, *args: Any) -> Any:
        if not self.alive:
            raise self._not_running()
        token = next(self._tokens)
        data = command_frame(token, name, args)  # before registering: a pickling error is the caller's
        fut = self.loop.create_future()
        self._replies[token] = fut
        try:
            self._transport.write(data)
            return await fut
        finally:
            self._replies.pop(token, None)

    def _send(self, token: int | None, name: str, args: tuple) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(command_frame(token, name, args))

    # -- messages from the engine process (event loop) -------------------------------------------
    def _on_message(self, message: tuple | BadFrame) -> None:
        if isinstance(message, BadFrame):  # the engine process sends only builtin and kvgen types outside payloads
            print(f"kvgen serve: dropped an unreadable message from the engine process ({message.error!r})",
                  file=sys.stderr, flush=True)
            return
        kind = message[0]
        if kind == "step":
            _, items, stats = message
            for wire, finished in items:
                route = self._route(wire[0], finished)
                if route is not None:
                    stream, index, prompt = route
                    stream.push(index, decode_output(wire, prompt), finished)
            if self.metrics is not None:
                self.metrics.apply(stats)
        elif kind == "reply":
            _, token, ok, payload = message
            fut = self._replies.pop(token, None)
            if fut is not None and not fut.done():
                try:
                    value = load_payload(payload, "the engine process's reply")
                except EngineProcessError as e:  # that call's error: the channel and the engine are fine
                    ok, value = False, e
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif kind == "failed":
            _, error, request_ids = message
            self._error = error
            self._fail_routes(error, request_ids)
        elif kind == "stopped":
            self._summary = message[1]
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_result(None)

    def _on_lost(self) -> None:
        """End of file: the engine process closed its end (stopping) or died."""
        self._child_gone()

    def _on_exit(self) -> None:
        """The process's sentinel: it exited. Its last messages may still be unread: look again shortly."""
        self.loop.remove_reader(self._proc.sentinel)
        self.loop.call_later(1.0, self._child_gone)

    def _child_gone(self) -> None:
        if self._gone:
            return
        self._gone = True
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
        if not self._stopping and self._error is None:
            code = self._proc.exitcode  # polled (before the reaper waits on it): known unless its exit is under way
            self._error = EngineProcessError("the engine process exited " + (
                f"with code {code}" if code is not None else "(its end of the socket closed)"))
        self._start_reaping()
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(self._not_running())
        if not self._stopping:  # (stopping: stop() ends the streams left)
            self._fail_routes(self._error, list(self._routes))

    # -- ending the process ---------------------------------------------------------------------
    def _start_reaping(self) -> asyncio.Future:
        """:meth:`_reap` in an executor (once; the event loop never waits on the process), its future."""
        if self._reaping is None:
            self._reaping = self.loop.run_in_executor(None, self._reap)
        return self._reaping

    def _reap(self) -> None:
        """Wait for the engine process to exit (killed after :data:`EXIT_TIMEOUT_S`); drop the exit hook."""
        proc = self._proc
        proc.join(EXIT_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        atexit.unregister(self._kill)

    def _kill(self) -> None:
        """Kill the engine process now (this interpreter exits without having stopped it, or start-up failed)."""
        proc = self._proc
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        atexit.unregister(self._kill)
        try:
            self._sock.close()
        except OSError:
            pass
