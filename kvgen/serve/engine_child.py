"""The engine process's side: build the engine from its spec, then run the EngineLoop on commands from the socket.

Started by :class:`kvgen.serve.engine_process.ProcessWorker` with
multiprocessing's ``spawn`` (a fresh interpreter: safe with CUDA, which a
forked child cannot use). :func:`child_main`:

1. ignores SIGINT and SIGTERM (a Ctrl-C in the terminal reaches the whole
   process group; the parent drains and then stops this process) and
   starts a thread that ends this process :data:`PARENT_GONE_GRACE_S`
   after the parent's death, for a parent that dies while the engine
   still loads (afterwards the loop notices the closed socket itself);
2. builds the engine (``spec.build()``; for ``tp > 1`` build_engine starts
   the ranks), sets it up as the server runs it, and sends ``("ready",
   EngineInfo)`` -- or ``("error", exception)`` and exits 1;
3. freezes the heap it has (see :func:`kvgen.serve.worker.hold_interpreter`)
   and runs :class:`~.engine_loop.EngineLoop` until a ``stop`` command, the
   parent's end of file, or a failing step;
4. closes the engine (stopping tp ranks; an error there is printed), sends
   ``("stopped", engine_summary)`` and exits at once (1 after a failure).

Messages in: ``(token, name, pickled args)`` with ``name`` one of
:data:`COMMANDS` (the EngineLoop method it runs); a command with a token is
answered ``("reply", token, ok, pickled result or exception)``. Arguments
this process cannot unpickle (a function of a module it cannot import) are
that command's error, answered like any other; the loop goes on. Out, besides those: per
step ``("step", [(encoded delta output, finished), ...], stats)`` and
on a failing step ``("failed", exception, request ids)``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import Any

from .channel import BadFrame, ChildChannel, EngineProcessError, dumps, encode_output, load_payload, portable_error
from .engine_loop import EngineLoop, engine_info, prepare_engine
from .stats import engine_summary
from .worker import hold_interpreter

COMMANDS = frozenset({"add", "abort", "call", "stats", "drain", "stop"})
PARENT_GONE_GRACE_S = 5.0


class _ChildPort:
    """The engine process's :class:`~.engine_loop.Port`: commands from the socket, outputs to it."""

    def __init__(self, channel: ChildChannel) -> None:
        self.channel = channel
        self.parent_gone = False

    def wait(self, timeout: float) -> None:
        self.channel.wait(timeout)

    def run_commands(self, loop: EngineLoop) -> None:
        messages = None if self.parent_gone else self.channel.receive()
        if messages is None:
            self.parent_gone = True
            loop.stop()  # nobody is listening: abort everything and exit
            return
        for message in messages:
            if isinstance(message, BadFrame):  # cannot happen with the parent's frames; no token to answer
                print(f"kvgen serve: the engine process dropped an unreadable command ({message.error!r})",
                      file=sys.stderr, flush=True)
                continue
            token, name, payload = message
            try:
                if name not in COMMANDS:
                    raise ValueError(f"unknown engine command {name!r}")
                args = load_payload(payload, f"the {name!r} command's arguments")
                result, ok = getattr(loop, name)(*args), True
            except BaseException as e:  # noqa: BLE001 -- answered to the caller, the loop goes on
                result, ok = e, False
            if token is not None:
                self.reply(token, ok, result)

    def reply(self, token: int, ok: bool, result: Any) -> None:
        """Answer command ``token``: its result, or (``ok`` False) its error as :func:`portable_error` makes it."""
        try:
            payload = dumps(result if ok else portable_error(result))
        except Exception as e:  # noqa: BLE001 -- a result that cannot be pickled is the caller's error
            ok, payload = False, dumps(portable_error(e))
        self.send(("reply", token, ok, payload))

    def emit(self, items: list[tuple[str, Any, bool]], stats: dict[str, Any] | None) -> None:
        self.send(("step", [(encode_output(out), finished) for _, out, finished in items], stats))

    def fail(self, error: BaseException, request_ids: list[str]) -> None:
        self.send(("failed", portable_error(error), request_ids))

    def send(self, message: Any) -> None:
        if not self.parent_gone and not self.channel.send(message):
            self.parent_gone = True  # the next run_commands stops the loop


def child_main(spec: Any, sock: Any) -> None:
    """The engine process's entry point (see the module); ``sock``: its end of the socket pair."""
    from kvgen.errors import is_user_error

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)  # a Python handler, unlike SIG_IGN, is not inherited by the ranks it starts
    _exit_with_parent()
    channel = ChildChannel(sock)
    try:
        engine = spec.build()
        prepare_engine(engine)
        info = engine_info(engine)
    except BaseException as e:  # noqa: BLE001 -- the parent raises it
        if not is_user_error(e):  # a user's mistake is one line, printed by the server
            traceback.print_exc()
        channel.send(("error", portable_error(e)))
        sys.exit(1)
    try:
        channel.send(("ready", info))
    except Exception as e:  # noqa: BLE001 -- pickling the tokenizer failed
        channel.send(("error", EngineProcessError(
            f"the engine's tokenizer cannot be sent to the server process ({type(e).__qualname__}: {e}); run the "
            f"engine in the server's process instead (kvgen serve --engine-in-process; build_app(engine) with "
            f"the engine rather than an EngineSpec)")))
        _close(engine)
        sys.exit(1)
    hold_interpreter(True)  # the model, torch and the engine: out of the collector's full collections
    port = _ChildPort(channel)
    loop = EngineLoop(engine, port)
    loop.run()
    finish(engine, port)
    channel.close()
    # Nothing is left to clean up: skip the interpreter's teardown of torch and the model (a second or more; the
    # parent waits for this exit) and the complaints of bindings whose objects gc.freeze kept alive.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if loop.error is not None else 0)


def finish(engine: Any, port: _ChildPort) -> None:
    """After the loop: close the engine and send ``("stopped", summary)`` -- sent whatever a broken engine raises."""
    try:
        summary = engine_summary(engine)
    except Exception:  # noqa: BLE001 -- a broken engine after a failed step
        summary = None
    _close(engine)
    port.send(("stopped", summary))


def _close(engine: Any) -> None:
    """``engine.close()``; an error is printed (after a failed step its tp ranks may be gone already)."""
    try:
        engine.close()
    except Exception:  # noqa: BLE001 -- the process exits next; the parent must still hear from it
        traceback.print_exc()


def _ignore(sig: int, frame: Any) -> None:
    pass


def _exit_with_parent() -> None:
    """End this process :data:`PARENT_GONE_GRACE_S` seconds after its parent's death (a daemon thread)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent's end of the spawn pipe closes: the parent exited
        threading.Event().wait(PARENT_GONE_GRACE_S)  # the loop usually exits cleanly first
        os._exit(1)

    threading.Thread(target=watch, name="kvgen-parent-watch", daemon=True).start()
