"""What keeps kvgen serve's streaming cheap at many clients (the HTTP overhead of issue 15).

- the server's engine hands over deltas (each step's new tokens and text,
  never a copy of a request's whole output); a request's mailbox merges
  them into one pending output per prompt: a handler that fell behind
  reads one output covering several engine steps (one multi-token chunk),
  the engine never queues a backlog (a drain's or stop's aborts are
  deltas too: see test_engine_loop);
- stream chunks are built from per-request templates, and equal the JSON
  the dict form (``Formatter.chunk``) gives, for both endpoints, with and
  without logprobs and usage;
- while a worker runs the interpreter's GIL switch interval is short (the
  engine thread waits at most that long for the GIL after a GPU wait) and
  the heap that existed at start is frozen out of the collector's full
  collections; both are undone when the server stops;
- the streamed response writes one body per wake-up, sends the last chunk,
  the usage and ``[DONE]`` in one write, and stops (closing the stream, so
  its requests are aborted) when the client disconnects.

The throughput itself is measured by ``python -m benchmarks.serve_load
--standin`` (too noisy on a shared CPU for an assertion here).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

pytest.importorskip("fastapi")

from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from kvgen.serve.protocol import ApiError  # noqa: E402
from kvgen.serve.responses import Choices, Delta, Formatter  # noqa: E402
from kvgen.serve.worker import SWITCH_INTERVAL_S, Stream  # noqa: E402


def words(tokens):
    return "".join(f"w{t} " for t in tokens)


def output(tokens, finished=False, text=None, logprobs=False):
    text = words(tokens) if text is None else text
    lps = [{t: -0.5 * t} for t in tokens] if logprobs else None
    comp = CompletionOutput(0, text, list(tokens), -float(len(tokens)), lps,
                            finish_reason="length" if finished else None)
    return RequestOutput("r0-0", None, [1, 2], [comp], finished, RequestMetrics(0.0))


def test_a_handler_behind_the_engine_gets_one_multi_token_chunk():
    async def go():
        s = Stream(["r0-0"])
        for k in range(499):  # 499 engine steps (one new token each) while the handler was busy elsewhere
            s.push(0, output([k], logprobs=True), False)
        assert len(s._latest) == 1  # nothing queued per step
        choices = Choices(1, [2])
        reader = s.batches()
        batch = await reader.__anext__()
        deltas = [d for i, out in batch for d in choices.update(i, out, out.finished)]
        assert len(deltas) == 1 and deltas[0].token_ids == list(range(499))
        assert deltas[0].text == words(range(499))
        assert deltas[0].logprobs == [{t: -0.5 * t} for t in range(499)]
        s.push(0, output([499, 500], finished=True, logprobs=True), True)
        batch = await reader.__anext__()
        deltas = [d for i, out in batch for d in choices.update(i, out, out.finished)]
        assert deltas[0].token_ids == [499, 500] and deltas[0].finish_reason == "length"
        assert deltas[0].text == "w499 w500 "
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
        assert s.done
        # the whole body: the same text, ids and logprobs as the cumulative output, usage counted once
        final = choices.final[0]
        assert final.text == words(range(501)) and final.token_ids == list(range(501))
        assert final.logprobs == [{t: -0.5 * t} for t in range(501)] and final.finish_reason == "length"
        assert choices.usage() == {"prompt_tokens": 2, "completion_tokens": 501, "total_tokens": 503}

    asyncio.run(go())


def test_merged_deltas_keep_the_newest_reasons_and_each_completion_apart():
    async def go():
        s = Stream(["r0-0"])
        two = lambda a, b, fin=None: RequestOutput(  # noqa: E731
            "r0-0", None, [1], [CompletionOutput(0, words(a), list(a), -1.0, None, fin),
                                CompletionOutput(1, words(b), list(b), -2.0, None, None)], False, RequestMetrics(0.0))
        s.push(0, two([1], [7]), False)
        s.push(0, two([2], []), False)
        s.push(0, two([], [8, 9], "stop"), False)
        [(i, out)] = await s.batches().__anext__()
        a, b = out.outputs
        assert (a.token_ids, a.text, a.finish_reason) == ([1, 2], "w1 w2 ", "stop")
        assert (b.token_ids, b.text, b.finish_reason, b.cumulative_logprob) == ([7, 8, 9], "w7 w8 w9 ", None, -2.0)
        choices = Choices(2, [1], keep=False)
        deltas = choices.update(i, out, out.finished)
        assert [(d.index, d.token_ids, d.finish_reason) for d in deltas] == [(0, [1, 2], "stop"), (1, [7, 8, 9], None)]
        # a finished choice sends nothing more while its sibling runs
        s.push(0, two([], [10]), False)
        [(i, out)] = await s.batches().__anext__()
        assert [(d.index, d.token_ids) for d in choices.update(i, out, out.finished)] == [(1, [10])]
        assert choices.final[0].token_ids == []  # keep=False: a stream keeps counts only
        assert choices.usage()["completion_tokens"] == 6

    asyncio.run(go())


def test_a_waiting_handler_wakes_on_push_and_on_failure():
    async def go():
        s = Stream(["r0-0", "r0-1"])
        got = asyncio.ensure_future(s.batches().__anext__())
        await asyncio.sleep(0)
        assert not got.done()
        s.push(1, output([5]), False)
        assert [i for i, _ in await asyncio.wait_for(got, 5)] == [1]
        s2 = Stream(["r1-0"])
        reader = s2.batches()
        waiting = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)
        s2.fail(RuntimeError("boom"))
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(waiting, 5)
        assert e.value.status == 500 and "boom" in e.value.message

    asyncio.run(go())


class _Prompter:
    def token_str(self, t):
        return f"t{t}\u00e9\""


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_sse_chunk_is_the_json_of_the_dict_chunk(chat, logprobs, usage):
    deltas = [Delta(0, 'a "quote"\u2603\n\\', [1, 7], [{1: -0.5, 2: -1.0}, {7: -0.1}] if logprobs else None, None,
                    True),
              Delta(1, "", [2], [{2: -0.25}] if logprobs else None, "stop", False),
              Delta(2, "x", [3], [{3: -2.0}] if logprobs else None, None, False)]
    fast = Formatter(chat, 'model "m"', _Prompter(), 2)
    ref = Formatter(chat, 'model "m"', _Prompter(), 2)
    ref.id, ref.created = fast.id, fast.created
    for _ in range(2):  # twice: completion logprobs carry text offsets from one chunk to the next
        event = fast.sse(deltas, usage)
        assert event.startswith("data: {") and event.endswith("}\n\n") and "\n" not in event[:-2]
        assert json.loads(event[len("data: "):]) == ref.chunk(deltas, usage)


def test_the_served_engine_hands_over_deltas():
    from .helpers import ServerThread, table_engine

    engine = table_engine()
    with ServerThread(engine):
        assert engine.output_kind == "delta"


def test_switch_interval_is_short_while_serving_and_restored_after():
    from .helpers import ServerThread, table_engine

    before = sys.getswitchinterval()
    with ServerThread(table_engine()):
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == pytest.approx(before)


async def _accepted_socket_has_nodelay() -> bool:
    """Serve one connection on kvgen's listening socket; whether the accepted socket has TCP_NODELAY set."""
    import socket

    from kvgen.serve.server import bind

    seen = asyncio.get_running_loop().create_future()

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    listener = bind("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Proto, sock=listener)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        nodelay = await asyncio.wait_for(seen, 10) != 0
        writer.close()
        return nodelay
    finally:
        server.close()
        await server.wait_closed()


def test_served_connections_have_nagle_off():
    """Each SSE chunk is a small write: with Nagle on it waits for the client's delayed ACK (~40 ms)."""
    assert asyncio.run(_accepted_socket_has_nodelay())


def test_served_connections_have_nagle_off_under_uvloop():
    """uvicorn serves on uvloop when it is installed (the serve extra): its connections must have Nagle off too."""
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(_accepted_socket_has_nodelay())
    finally:
        loop.close()


def test_the_heap_is_frozen_while_serving_and_unfrozen_after():
    """Full collections must not traverse the model's and libraries' objects while serving (100+ ms GIL pauses)."""
    import gc

    from kvgen.serve import worker

    from .helpers import ServerThread, table_engine

    others = worker._switch_users  # the session's engine-process server (conftest) may be running in this process
    assert (gc.get_freeze_count() == 0) == (others == 0)
    with ServerThread(table_engine()):
        assert gc.get_freeze_count() > 1000
    # the last server to stop unfreezes: none else running here, nothing frozen
    assert (gc.get_freeze_count() == 0) == (worker._switch_users == 0)


def _sse_messages(stream, choices, fmt, usage, receive=None):
    """Run an SSEResponse against fake ASGI callables; returns (messages sent, whether on_close ran)."""
    from kvgen.serve.sse import SSEResponse

    sent, closed = [], []

    async def send(message):
        sent.append(message)

    async def never():
        await asyncio.sleep(3600)

    response = SSEResponse(stream, choices, fmt, usage, closed.append)
    return response({"type": "http"}, receive or never, send), sent, closed


def test_sse_response_writes_one_body_per_wake_up_and_ends_with_usage_and_done_in_one_write():
    async def go():
        s = Stream(["r0-0"])
        fmt = Formatter(False, "m", _Prompter(), 0)
        run, sent, closed = _sse_messages(s, Choices(1, [2], keep=False), fmt, True)
        task = asyncio.ensure_future(run)
        s.push(0, output([1]), False)
        s.push(0, output([2]), False)  # before the handler ran: merged into one chunk
        for _ in range(5):
            await asyncio.sleep(0)
        s.push(0, output([3], finished=True), True)
        await asyncio.wait_for(task, 5)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
        bodies = [m["body"].decode() for m in sent[1:]]
        assert [m["more_body"] for m in sent[1:]] == [True, False]
        first = [json.loads(e[len("data: "):]) for e in bodies[0].split("\n\n") if e]
        assert len(first) == 1 and first[0]["choices"][0]["text"] == "w1 w2 "
        last = bodies[1].split("\n\n")
        assert json.loads(last[0][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert json.loads(last[1][len("data: "):])["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                "total_tokens": 5}
        assert last[2:] == ["data: [DONE]", ""]
        assert closed == [s]

    asyncio.run(go())


def test_sse_response_stops_and_closes_when_the_client_disconnects():
    async def go():
        s = Stream(["r0-0"])
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        run, sent, closed = _sse_messages(s, Choices(1, [2], keep=False), Formatter(True, "m", _Prompter(), 0),
                                          False, receive)
        task = asyncio.ensure_future(run)
        s.push(0, output([1]), False)
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(sent) == 2 and not closed  # headers and one chunk; the stream is still open
        gone.set()
        await asyncio.wait_for(task, 5)
        assert s.closed and closed == [s] and len(sent) == 2  # nothing written after the client left

    asyncio.run(go())
