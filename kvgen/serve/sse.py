"""The streamed response: server-sent events from a :class:`Stream`, written with as little work per chunk as can be.

At many clients the event loop writes one chunk per client and engine
step, so every microsecond per chunk counts: against the engine when it
runs on a thread of this process (one GIL), against the chunk rate the
event loop keeps up with in any case. :class:`SSEResponse` is a plain ASGI response
(not Starlette's StreamingResponse: no async generator to resume, no
task group per request, no extra empty write at the end):

- one ``send`` per wake-up, holding every prompt's new tokens;
- the last wake-up's chunk, the usage chunk (``include_usage``) and
  ``data: [DONE]`` go out as the response's final body in one write;
- the body is written by a task of its own, so an engine step's wake-up
  resumes that task only, not the whole chain of ASGI middleware
  coroutines the response was called from;
- a task waits for the client's ``http.disconnect`` and cancels the stream
  (ASGI servers drop writes to a gone client silently, so only ``receive``
  tells); the caller's ``on_close`` then aborts the unfinished requests,
  freeing their pages before the next engine step.

An engine failure mid-stream is sent as an OpenAI error event before
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from .protocol import ApiError
from .responses import Choices, Formatter
from .stream import Stream

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(Response):
    """``text/event-stream`` of ``stream``'s outputs as OpenAI chunks; ``on_close(stream)`` runs at the end, always."""

    media_type = "text/event-stream"

    def __init__(self, stream: Stream, choices: Choices, fmt: Formatter, include_usage: bool,
                 on_close: Callable[[Stream], None]) -> None:
        self.stream = stream
        self.choices = choices
        self.fmt = fmt
        self.include_usage = include_usage
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(HEADERS)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        stream = self.stream
        watch = body = None
        try:
            watch = asyncio.ensure_future(_cancel_on_disconnect(receive, stream))
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # The body runs as its own task: each engine step then resumes two frames, not the ~20 coroutine
            # frames of the ASGI middleware chain this call is nested in (resumed once, at the end).
            body = asyncio.ensure_future(self._body(send))
            await body  # cancelling this call (server shutdown) cancels the body too
        finally:
            for t in (watch, body):
                if t is not None:
                    t.cancel()
            self.on_close(stream)

    async def _body(self, send: Any) -> None:
        stream, choices, fmt, usage = self.stream, self.choices, self.fmt, self.include_usage
        tail = ""
        try:
            while (batch := await stream.next_batch()) is not None:
                events = []
                for index, out in batch:
                    deltas = choices.update(index, out, out.finished)
                    if deltas:
                        events.append(fmt.sse(deltas, usage))
                if not events:
                    continue
                if stream.done:  # the last chunk goes out with the usage and [DONE], in one write
                    tail = "".join(events)
                    break
                await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})
        except ApiError as e:
            tail += f"data: {json.dumps(e.body())}\n\n"
        if stream.closed:
            return  # the client is gone: nothing more to write
        if usage:
            tail += f"data: {json.dumps(fmt.usage_chunk(choices.usage()))}\n\n"
        await send({"type": "http.response.body", "body": (tail + "data: [DONE]\n\n").encode(), "more_body": False})


async def _cancel_on_disconnect(receive: Any, stream: Stream) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()
