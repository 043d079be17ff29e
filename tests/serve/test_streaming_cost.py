"""What keeps kvgen serve's streaming cheap at many clients (the HTTP overhead of issue 15).

- a request's outputs arrive in a mailbox holding the newest snapshot per
  prompt: a handler that fell behind reads one output covering several
  engine steps (one multi-token chunk), the engine never queues a backlog;
- stream chunks are built from per-request templates, and equal the JSON
  the dict form (``Formatter.chunk``) gives, for both endpoints, with and
  without logprobs and usage;
- while a worker runs the interpreter's GIL switch interval is short (the
  engine thread waits at most that long for the GIL after a GPU wait), and
  it is restored when the server stops.

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


def snapshot(tokens, finished=False, text=None):
    text = "".join(f"w{t} " for t in tokens) if text is None else text
    comp = CompletionOutput(0, text, list(tokens), finish_reason="length" if finished else None)
    return RequestOutput("r0-0", None, [1, 2], [comp], finished, RequestMetrics(0.0))


def test_a_handler_behind_the_engine_gets_one_multi_token_chunk():
    async def go():
        s = Stream(["r0-0"])
        for k in range(1, 500):  # 499 engine steps while the handler was busy elsewhere
            s.push(0, snapshot(range(k)), False)
        assert len(s._latest) == 1  # nothing queued per step
        choices = Choices(1, None, [2])
        batches = []
        reader = s.batches()
        batch = await reader.__anext__()
        batches.append(batch)
        deltas = [d for i, out in batch for d in choices.update(i, out, out.finished)]
        assert len(deltas) == 1 and deltas[0].token_ids == list(range(499))
        assert deltas[0].text == "".join(f"w{t} " for t in range(499))
        s.push(0, snapshot(range(501), finished=True), True)
        batch = await reader.__anext__()
        deltas = [d for i, out in batch for d in choices.update(i, out, out.finished)]
        assert deltas[0].token_ids == [499, 500] and deltas[0].finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await reader.__anext__()
        assert s.done

    asyncio.run(go())


def test_a_waiting_handler_wakes_on_push_and_on_failure():
    async def go():
        s = Stream(["r0-0", "r0-1"])
        got = asyncio.ensure_future(s.batches().__anext__())
        await asyncio.sleep(0)
        assert not got.done()
        s.push(1, snapshot([5]), False)
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


def test_switch_interval_is_short_while_serving_and_restored_after():
    from .helpers import ServerThread, table_engine

    before = sys.getswitchinterval()
    with ServerThread(table_engine()):
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == pytest.approx(before)


def test_served_connections_have_nagle_off():
    """Each SSE chunk is a small write: with Nagle on it waits for the client's delayed ACK (~40 ms)."""
    import socket

    from kvgen.serve.server import bind

    async def go():
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
            assert await asyncio.wait_for(seen, 10) != 0
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(go())
