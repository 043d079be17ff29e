"""The workers' life cycle, both kinds: draining from a signal handler, stop ends what is open.

``begin_drain`` (called from uvicorn's signal handler, on the event loop's
thread) takes no lock the code it interrupted may hold. ``stop`` with
streams still open ends every one of them -- with its last output (finish
reason ``abort``) from an engine that stops, or ApiError 503 from one
killed past the stop timeout -- and fails the calls still waiting for an
answer. Both route outputs the same way: a failing step ends every open
stream with 500, a closed stream gets nothing more, and a drain's deadline
counts from ``begin_drain``, not from when the busy engine reads it.
(Start-up and drains through HTTP are tested in test_engine_process,
test_api and test_stories.)
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

from .helpers import engine_all_free, engine_sleep, table_engine, table_spec  # noqa: E402

LONG = SamplingParams(max_tokens=200, temperature=0)
KINDS = ["thread", "process"]


def _worker(kind: str, delay: float):
    """A worker of ``kind`` ("thread" or "process") over the stand-in engine whose steps take ``delay`` s."""
    if kind == "thread":
        return EngineWorker(table_engine(delay=delay), max_pending=4)
    return ProcessWorker(table_spec(delay=delay), max_pending=4)


def _run_started(kind: str, body) -> None:
    """``await body(worker)`` with a started worker of ``kind`` (steps of 20 ms), stopped afterwards."""
    async def go():
        w = _worker(kind, 0.02)
        await w.start()
        try:
            await body(w)
        finally:
            await w.stop()

    asyncio.run(go())


def break_steps(engine) -> None:
    """Run on the engine: every later step raises (as a CUDA error would)."""
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    engine.runner.run = boom


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
            w.begin_drain(2.0)
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


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_step_ends_every_open_stream_with_500(kind):
    async def body(w):
        streams = [await _running_stream(w) for _ in range(2)]
        await w.call(break_steps)
        for stream in streams:
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(_rest(stream), 30)
            assert e.value.status == 500 and "boom" in e.value.message
        assert not w.alive and not w._routes

    _run_started(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_stream_gets_nothing_more_and_its_pages_are_freed(kind):
    async def body(w):
        stream = await _running_stream(w)
        w.close(stream)  # its client went away while a step was running
        assert not w._routes
        await asyncio.sleep(0.3)  # more than ten steps' time
        assert not stream._latest  # the step in flight when it closed pushed nothing into it
        assert await w.call(engine_all_free)

    _run_started(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_the_drain_deadline_counts_from_begin_drain_not_from_when_the_busy_engine_reads_it(kind):
    async def body(w):
        stream = await _running_stream(w)
        busy = asyncio.ensure_future(w.call(engine_sleep, 3.0))  # the drain command waits behind this call
        await asyncio.sleep(0.1)
        started = time.monotonic()
        w.begin_drain(2.0)
        outs = await asyncio.wait_for(_rest(stream), 30)
        elapsed = time.monotonic() - started
        await busy
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        # deadline 2 s after begin_drain, passed while the engine was busy: aborted as soon as it is free,
        # about 2.9 s after begin_drain (counted from when the engine read the command: 2.9 + 2 s)
        assert 2.0 <= elapsed < 4.0, elapsed

    _run_started(kind, body)
