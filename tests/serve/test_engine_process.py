"""The engine in its own process: its death reaches every open stream and /health; it never outlives the server.

A killed engine process ends each open stream with an OpenAI error event
(status 500) and makes /health answer 503 and new requests 503; the engine
process exits when the server's end of the socket closes, and when the
server process is killed; a failing build raises the engine's own error in
the server; a spec that cannot be pickled is refused before any process
starts. (Outputs, disconnects, drains and metrics are tested on both
worker kinds in test_api, test_load and test_stories.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvgen.serve.engine_process import EngineProcessError, EngineSpec, ProcessWorker  # noqa: E402

from .helpers import MODEL, ServerThread, table_spec  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_engine_process_fails_open_streams_with_500_and_health_reports_it():
    with ServerThread(table_spec(delay=0.05)) as s:
        pid = s.worker.pid
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}
        events = []
        with httpx.stream("POST", s.url + "/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)  # mid-stream
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and error["type"] == "internal_error", error
        assert "engine process exited" in error["message"], error
        deadline = time.monotonic() + 10
        while (health := httpx.get(s.base + "/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.json()["status"] == "error" and "exited" in health.json()["error"]
        r = httpx.post(s.url + "/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(s.base + "/metrics").status_code == 200  # the HTTP side's own series still render
    assert s.summary is None  # nothing to report from a dead engine


def _num_requests(engine):
    return engine.num_unfinished_requests()


def test_calls_and_the_engine_process_exiting_when_the_servers_end_of_the_socket_closes():
    async def go(w):
        await w.start()
        try:
            with pytest.raises(Exception, match="pickle"):  # a lambda cannot reach the engine process
                await w.call(lambda engine: None)
            assert await w.call(_num_requests) == 0
            w._transport.close()  # what the kernel does when the server's process dies
            await asyncio.get_running_loop().run_in_executor(None, w._proc.join, 20)
            assert w._proc.exitcode == 0  # it noticed, aborted what it held and exited normally
            assert not w.alive
        finally:
            await w.stop()

    asyncio.run(go(ProcessWorker(table_spec(), max_pending=4)))


def test_the_engine_process_exits_when_the_server_process_is_killed(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {TESTS!r})
        if __name__ == "__main__":
            from kvgen.serve.engine_process import ProcessWorker
            from serve.helpers import table_spec
            w = ProcessWorker(table_spec(), max_pending=4)
            print(w.pid, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert _gone_within(pid, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failing_build_raises_the_engines_error_in_the_server():
    from kvgen.engine.errors import EngineError

    started = time.monotonic()
    with pytest.raises(EngineError, match="no model folder at /nowhere"):
        ProcessWorker(EngineSpec("serve.helpers:broken_engine", {"message": "no model folder at /nowhere"}),
                      max_pending=4)
    assert time.monotonic() - started < 60


def test_a_spec_that_cannot_be_pickled_is_refused_before_a_process_starts():
    with pytest.raises(EngineProcessError, match="module-level function"):
        ProcessWorker(EngineSpec(lambda: None), max_pending=4)
