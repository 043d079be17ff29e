"""Stream: the mailbox of one HTTP request's engine requests (one per prompt), read by its handler.

Both workers (the engine thread of :mod:`.worker`, the engine process of
:mod:`.engine_process`) hand each engine step's delta outputs to the event
loop, which pushes them here; a handler reads them with
:meth:`Stream.next_batch`. Event loop only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .protocol import ApiError


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
    (thread or process) never waits on the handler: its deltas are dropped
    in by one event-loop callback per step for all streams.
    """

    __slots__ = ("request_ids", "finished", "closed", "_latest", "_ended", "_error", "_waiter")

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.finished: set[str] = set()  # ids whose last output the handler has taken
        self.closed = False  # the reader gave up (its client went away): next_batch() returns None
        # prompt index -> [pending merged output, finished, {completion index: text pieces}]
        self._latest: dict[int, list] = {}
        self._ended: set[int] = set()  # prompt indices whose last output was pushed
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    @property
    def ended(self) -> bool:
        """Every prompt's last output was pushed, or the stream failed: nothing more will arrive."""
        return self._error is not None or len(self._ended) == len(self.request_ids)

    # event loop: called by the worker's per-step callback
    def push(self, index: int, out: Any, finished: bool) -> None:
        """Merge the delta ``out`` of prompt ``index`` (``finished``: its last) into its pending output."""
        if finished:
            self._ended.add(index)
        pending = self._latest.get(index)
        if pending is None:
            self._latest[index] = [out, finished, None]
        else:
            pending[2] = _merge(pending[0], out, pending[2])
            pending[1] = finished
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: its reader gets it as it is if an ApiError, else as an engine failure."""
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
        :meth:`cancel`. An engine failure is ApiError 500, an ApiError given to
        :meth:`fail` is raised as it is. (A plain coroutine,
        not an async generator: a streaming handler calls it once per engine
        step, so each call must cost little.)
        """
        while True:
            if self.closed or self.done:
                return None
            if self._error is not None:
                e = self._error
                if isinstance(e, ApiError):
                    raise e
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

