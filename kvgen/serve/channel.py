"""The engine process's channel to its parent: pickled messages in length-prefixed frames over a socket pair.

A frame is 8 bytes of little-endian length, then ``pickle.dumps(message)``.
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
import pickle
import select
import socket
from collections.abc import Callable
from typing import Any

from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

HEADER = 8
BUFFER_BYTES = 4 << 20
"""Socket buffers asked for (the kernel may cap them): a step's outputs fit without the child waiting on the parent."""


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(HEADER, "little") + data


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
    """Bytes in, whole messages out."""

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
            out.append(pickle.loads(buf[pos + HEADER:pos + HEADER + n]))
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
    """The parent's end on its event loop: each whole message goes to ``on_message``; end of file to ``on_lost``."""

    def __init__(self, reader: FrameReader, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self.reader = reader
        self.on_message = on_message
        self.on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        for message in self.reader.feed(data):
            self.on_message(message)

    def eof_received(self) -> bool:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost()


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError that names it (sent to the parent)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- any exception type may refuse to be pickled
        return RuntimeError(f"{type(error).__name__}: {error}")


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
