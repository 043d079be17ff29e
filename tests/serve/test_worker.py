"""The workers' life cycle, both kinds: draining from a signal handler, stop ends what is open.

``begin_drain`` (called from uvicorn's signal handler, on the event loop's
thread) takes no lock the code it interrupted may hold. ``stop`` with
streams still open ends every one of them -- with its last output (finish
reason ``abort``) from an engine that stops, or ApiError 503 from one
killed past the stop timeout -- and fails the calls still waiting for an
answer. (Start-up, failures and drains through HTTP are tested in
test_engine_process, test_api and test_stories.)
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")

from kvgen.engine.sampling_params import SamplingParams  # noqa: E402
from kvgen.serve.engine_process import ProcessWorker  # noqa: E402
from kvgen.serve.protocol import ApiError  # noqa: E402
from kvgen.serve.worker import EngineWorker  # noqa: E402

from .helpers import engine_sleep, table_engine, table_spec  # noqa: E402

LONG = SamplingParams(max_tokens=200, temperature=0)


async def _running_stream(worker):
    """A stream of one long request whose first output has been read."""
    stream = await worker.submit([[1, 2, 3]], LONG, time.perf_counter())
    assert await asyncio.wait_for(stream.next_batch(), 30)
    return stream


async def _rest(stream):
    outs = []
    while (batch := await stream.next_batch()) is not None:
        outs += [out for _, out in batch]
    return outs


def test_begin_drain_in_a_signal_handler_does_not_wait_for_the_lock_of_the_code_it_interrupted():
    w = EngineWorker(table_engine(), max_pending=4)
    w.loop = loop = asyncio.new_event_loop()
    returned = threading.Event()

    def sigterm_during_a_put():
        with w._port.wake._cond:  # the Event's lock, as a submit's put holds it when the signal arrives
            w.begin_drain(1.0)
        returned.set()

    threading.Thread(target=sigterm_during_a_put, daemon=True).start()
    try:
        assert returned.wait(2), "begin_drain deadlocked"
        loop.run_until_complete(asyncio.sleep(0))  # the event loop queues the drain
        assert w.draining and w._port.commands.qsize() == 1
    finally:
        loop.close()


def test_stop_gives_each_open_stream_its_last_output():
    async def go():
        w = EngineWorker(table_engine(delay=0.02), max_pending=4)
        await w.start()
        stream = await _running_stream(w)
        reader = asyncio.ensure_future(_rest(stream))
        summary = await w.stop()
        outs = await asyncio.wait_for(reader, 5)
        assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert summary["requests"] == 0 and summary["pages_used"] == 0

    asyncio.run(go())


def test_stop_of_a_stuck_engine_process_fails_open_streams_and_waiting_calls():
    async def go():
        w = ProcessWorker(table_spec(delay=0.02), max_pending=4)
        await w.start()
        stream = await _running_stream(w)
        stuck = asyncio.ensure_future(w.call(engine_sleep, 60))
        await asyncio.sleep(0.2)  # the engine is in the call: the stop command waits behind it
        started = time.monotonic()
        assert await w.stop(timeout=0.5) is None  # killed: no summary
        assert time.monotonic() - started < 10
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(stream.next_batch(), 5)
        assert e.value.status == 503 and "server stopped" in e.value.message
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(stuck, 5)
        assert e.value.status == 503

    asyncio.run(go())
