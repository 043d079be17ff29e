"""The engine process's channel to its parent: pickled messages in length-prefixed frames over a socket pair.

A frame is 8 bytes of little-endian length, then ``pickle.dumps(message)``.
Each frame is unpickled on its own (:class:`FrameReader`): one that cannot
be (a class the reading process cannot import) becomes a :class:`BadFrame`
and the frames after it still arrive. What may hold objects of the user's
classes -- a command's arguments, a reply's result -- travels as pickled
bytes inside its frame (:func:`command_frame`, :func:`load_payload`), so the
side that cannot read it answers that one command or call with an error
instead of losing the channel. Errors cross as :func:`portable_error` makes them.

The parent reads and writes through asyncio (:class:`ParentProtocol`; the
transport buffers writes, so the event loop never blocks on a child busy
in a step); the child uses blocking calls between its steps
(:class:`ChildChannel`). Only the child ever blocks on a write, so the two
cannot deadlock on full buffers.

Outputs cross as tuples (:func:`encode_output`, :func:`decode_output`),
which pickle several times faster than the dataclasses, and without the
prompt's token ids: the engine puts them in every output, the parent
already holds them.
"""

from __future__ import annotations

import asyncio
import io
import pickle
import select
import socket
import traceback
from collections.abc import Callable
from typing import Any

from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvgen.errors import KvgenError, is_user_error

HEADER = 8
BUFFER_BYTES = 4 << 20
"""Socket buffers asked for (the kernel may cap them): a step's outputs fit without the child waiting on the parent."""


class EngineProcessError(KvgenError):
    """The engine process could not start or exited, or something it sent cannot be read here (or the reverse).

    Also the stand-in for a user's mistake the engine process raised whose
    class the server cannot import (see :func:`portable_error`).
    """


class BadFrame:
    """A frame that could not be unpickled (in place of its message); ``error`` says why."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def frame(message: Any) -> bytes:
    data = dumps(message)
    return len(data).to_bytes(HEADER, "little") + data


def command_frame(token: int | None, name: str, args: tuple) -> bytes:
    """The frame of a command: ``(token, name, pickled args)`` (raises the pickling error of ``args``)."""
    return frame((token, name, dumps(args)))


def load_payload(data: bytes, what: str) -> Any:
    """Unpickle ``data`` (``what`` it is, for the error); EngineProcessError when this process cannot."""
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 -- most likely a class from a module this process cannot import
        raise EngineProcessError(f"{what} cannot be unpickled in this process ({type(e).__qualname__}: {e}); only "
                                 f"objects of modules both the server and the engine process import can cross "
                                 f"(e.g. module-level functions of an importable module)") from None


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """``(parent's end, child's end)``: a connected pair of stream sockets with large buffers."""
    a, b = socket.socketpair()
    for s in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
            except OSError:
                pass
    return a, b


class FrameReader:
    """Bytes in, whole messages out (a :class:`BadFrame` for each that cannot be unpickled)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        end = len(buf)
        while end - pos >= HEADER:
            n = int.from_bytes(buf[pos:pos + HEADER], "little")
            if end - pos - HEADER < n:
                break
            try:
                out.append(pickle.loads(buf[pos + HEADER:pos + HEADER + n]))
            except Exception as e:  # noqa: BLE001 -- that frame only: the next one starts after it all the same
                out.append(BadFrame(e))
            pos += HEADER + n
        if pos:
            del buf[:pos]
        return out


class ChildChannel:
    """The child's end: blocking sends, non-blocking receives, a wait for the next message."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.reader = FrameReader()

    def send(self, message: Any) -> bool:
        """Send ``message``; False when the parent is gone. (A message that cannot be pickled raises.)"""
        data = frame(message)
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        return True

    def wait(self, timeout: float) -> None:
        """Block until something can be read (or end of file), or ``timeout`` seconds."""
        select.select([self.sock], [], [], timeout)

    def receive(self) -> list[Any] | None:
        """The messages that arrived (possibly none) without blocking; None once the parent closed its end."""
        out: list[Any] = []
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return None
            if not data:
                return None
            out += self.reader.feed(data)

    def close(self) -> None:
        self.sock.close()


class ParentProtocol(asyncio.Protocol):
    """The parent's end on its event loop: each whole message goes to ``on_message``; end of file to ``on_lost``.

    An exception from ``on_message`` is printed and the next message
    handled: raised out of ``data_received`` asyncio would close the
    transport, losing a live engine process.
    """

    def __init__(self, reader: FrameReader, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self.reader = reader
        self.on_message = on_message
        self.on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        for message in self.reader.feed(data):
            try:
                self.on_message(message)
            except Exception:  # noqa: BLE001 -- a bug in handling one message must not cut the channel
                traceback.print_exc()

    def eof_received(self) -> bool:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost()


CROSSING_MODULES = frozenset({"builtins", "copyreg", "_codecs"})
"""Besides ``kvgen`` and its modules, what an error sent to the server may reference (builtin exceptions' pickles)."""


class _CrossingUnpickler(pickle.Unpickler):
    """Unpickles only classes of builtins and kvgen's own modules: what the server process surely imports."""

    def find_class(self, module: str, name: str) -> Any:
        if module in CROSSING_MODULES or module == "kvgen" or module.startswith("kvgen."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a builtin or kvgen class")


def portable_error(error: BaseException) -> BaseException:
    """``error`` as it is sent to the other process: itself when that can surely unpickle it, else a stand-in.

    Itself: an error whose pickle references only builtin and kvgen
    classes (its type, and anything in its arguments and attributes). Any
    other -- a class of the user's module, of a generated
    ``kvgen_generated_*`` package, of torch -- might not be importable on
    the other side (it would arrive as a ModuleNotFoundError): it is
    replaced by an EngineProcessError (a KvgenError) when it was a user's
    mistake (a KvgenError, or the runtime's KvgenRuntimeError), else by a
    RuntimeError (a bug), with the message
    ``"QualName: message"``.
    """
    try:
        _CrossingUnpickler(io.BytesIO(dumps(error))).load()
        return error
    except Exception:  # noqa: BLE001 -- any exception type may refuse to be pickled
        message = f"{type(error).__qualname__}: {error}"
        return EngineProcessError(message) if is_user_error(error) else RuntimeError(message)


def encode_output(out: RequestOutput) -> tuple:
    m = out.metrics
    return (out.request_id, out.finished, out.num_cached_tokens, out.prompt,
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time),
            [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
             for c in out.outputs])


def decode_output(t: tuple, prompt_token_ids: list[int]) -> RequestOutput:
    """The RequestOutput :func:`encode_output` made ``t`` from; ``prompt_token_ids`` is the parent's own list."""
    rid, finished, cached, prompt, m, comps = t
    return RequestOutput(rid, prompt, prompt_token_ids, [CompletionOutput(*c) for c in comps], finished,
                         RequestMetrics(*m), cached)
