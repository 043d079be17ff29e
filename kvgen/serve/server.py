"""Running the app under uvicorn, with kvgen's drain on SIGTERM.

On SIGTERM (or the first Ctrl-C) the server stops listening, answers 503
to any request still arriving on an open connection, lets running requests
finish, aborts those left after ``drain_timeout`` seconds (their streams end
with finish reason ``abort``), stops the engine (its thread, or its
process) and returns normally -- so ``kvgen serve`` exits 0. (Plain uvicorn re-raises the signal after
its graceful shutdown, which would end the process with -SIGTERM.)
"""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

SHUTDOWN_GRACE_S = 5.0
"""Beyond the drain timeout: how long uvicorn waits for aborted streams to close before cancelling them."""


class DrainingServer(uvicorn.Server):
    """A uvicorn Server that drains the app's worker on shutdown and exits normally on SIGTERM."""

    def __init__(self, config: uvicorn.Config, worker: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.worker.begin_drain(self.drain_timeout)
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)  # uvicorn >= 0.29 re-raises these after shutdown
        if sig == signal.SIGTERM and isinstance(captured, list):  # a drained SIGTERM is a normal exit
            captured[:] = [s for s in captured if s != signal.SIGTERM]

    def request_exit(self) -> None:
        """Drain and stop as on SIGTERM (for servers run in a thread, which receive no signals)."""
        self.worker.begin_drain(self.drain_timeout)
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one; read it with getsockname).

    It listens at once, so clients that connect while the model loads wait
    in the backlog instead of being refused. Made with protocol IPPROTO_TCP
    (not 0): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    sockets that say so, and with Nagle on each small SSE write after the
    headers waited for the client's delayed ACK (~40 ms): tokens arrived in
    bursts and the first one late.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def make_server(app: Any, *, drain_timeout: float, log_level: str = "warning") -> DrainingServer:
    """A DrainingServer for an app from :func:`kvgen.serve.app.build_app`; run it with ``.run(sockets=[sock])``."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=drain_timeout +
                            SHUTDOWN_GRACE_S, access_log=False, timeout_keep_alive=5)
    return DrainingServer(config, app.state.serve.worker, drain_timeout)
