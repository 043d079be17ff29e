"""The engine in its own process: its death reaches every open stream and /health; it never outlives the server.

A killed engine process ends each open stream with an OpenAI error event
(status 500) and makes /health answer 503 and new requests 503; the engine
process exits when the server's end of the socket closes, and when the
server process is killed; a failing build raises the engine's own error in
the server, a tokenizer that cannot be sent and a build past the start
timeout an EngineProcessError; a spec that cannot be pickled is refused
before any process starts; the engine process reports it stopped even when
closing a broken engine fails. What one side cannot unpickle (a function the engine process cannot
import, a result or error of a class the server cannot) fails only that
call: the engine and the channel go on. (Outputs, disconnects, drains and metrics are tested on both
worker kinds in test_api, test_load and test_stories.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import pickle
import subprocess
import sys
import textwrap
import time
import types

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kvgen.errors import KvgenError, is_user_error  # noqa: E402
from kvgen.serve.channel import BadFrame, FrameReader, frame, portable_error  # noqa: E402
from kvgen.serve.engine_process import EngineProcessError, EngineSpec, ProcessWorker  # noqa: E402

from .helpers import (MODEL, ServerThread, foreign_class, foreign_error, foreign_result, pid_gone,  # noqa: E402
                      table_spec)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds the tests package




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


SERVER_ONLY = "kvgen_serve_test_server_only"


def _server_only_function():
    """A function of a module that exists in this process only (the engine process cannot import it)."""
    module = types.ModuleType(SERVER_ONLY)
    exec("def fn(engine):\n    return 0\n", module.__dict__)
    sys.modules[SERVER_ONLY] = module
    return module.fn


def test_calls_and_the_engine_process_exiting_when_the_servers_end_of_the_socket_closes():
    async def call(w, *args):
        return await asyncio.wait_for(w.call(*args), 30)

    async def go(w):
        await w.start()
        try:
            with pytest.raises(Exception, match="pickle"):  # a lambda cannot reach the engine process
                await w.call(lambda engine: None)
            # what one side cannot unpickle is that call's error; the engine, its loop and the channel go on
            with pytest.raises(EngineProcessError, match="'call' command's arguments cannot be unpickled"):
                await call(w, _server_only_function())
            with pytest.raises(EngineProcessError, match="reply cannot be unpickled"):
                await call(w, foreign_result)
            with pytest.raises(EngineProcessError, match="^ForeignKvgenError: out of pages"):
                await call(w, foreign_error, True)
            with pytest.raises(RuntimeError, match="^ForeignValueError: out of pages") as e:
                await call(w, foreign_error, False)
            assert not isinstance(e.value, KvgenError)  # a bug stays a bug
            assert await call(w, _num_requests) == 0
            assert w.alive
            w._transport.close()  # what the kernel does when the server's process dies
            # The worker's own reaper joins it (killed after EXIT_TIMEOUT_S; connection_lost starts it, or this
            # call): a second join on another thread races it for waitpid and may see no exit code at all.
            await asyncio.wait_for(asyncio.shield(w._start_reaping()), 30)
            assert w._proc.exitcode == 0  # it noticed, aborted what it held and exited normally
            assert not w.alive
        finally:
            await w.stop()

    try:
        asyncio.run(go(ProcessWorker(table_spec(), max_pending=4)))
    finally:
        sys.modules.pop(SERVER_ONLY, None)


def test_a_frame_that_cannot_be_unpickled_leaves_the_frames_around_it():
    cls = foreign_class(object)
    data = frame(("a", 1)) + frame(cls()) + frame(("b", 2))
    del sys.modules[cls.__module__]  # as in a process that never had the class's module
    reader = FrameReader()
    out = reader.feed(data[:5]) + reader.feed(data[5:])
    assert out[0] == ("a", 1) and isinstance(out[1], BadFrame) and out[2] == ("b", 2)
    assert reader.feed(frame("c")) == ["c"]


def test_portable_errors_are_builtin_or_kvgen_types_else_a_stand_in_naming_the_type():
    from kvgen.engine.errors import EngineError

    for error in (ValueError("x"), EngineError("bad model"), EngineProcessError("gone")):
        assert portable_error(error) is error
    user = portable_error(foreign_class(KvgenError)("out of pages"))
    assert type(user) is EngineProcessError and str(user) == "ForeignKvgenError: out of pages"
    bug = portable_error(foreign_class(ValueError)("oops"))
    assert type(bug) is RuntimeError and str(bug) == "ForeignValueError: oops"
    wrapped = portable_error(ValueError(foreign_class(object)()))  # a builtin type holding a foreign object
    assert type(wrapped) is RuntimeError and wrapped.args[0].startswith("ValueError: ")
    unpicklable = portable_error(ValueError(lambda: None))
    assert type(unpicklable) is RuntimeError
    for error in (user, bug, wrapped, unpicklable):
        assert type(pickle.loads(pickle.dumps(error))) is type(error)


def test_a_generated_packages_runtime_error_crosses_as_a_users_mistake():
    # A generated package carries its own copy of the runtime: its KvgenRuntimeError (say, the Triton interpreter
    # not set on a CPU) is no KvgenError and its module is not kvgen's, yet it is the user's mistake: the server
    # must print one line for it, not a traceback.
    name = "kvgen_generated_test_pkg.runtime.errors"
    module = sys.modules.setdefault(name, types.ModuleType(name))
    base = type("KvgenRuntimeError", (Exception,), {"__module__": name})
    module.KvgenRuntimeError = base
    try:
        sub = type("OutOfPages", (base,), {"__module__": name})
        module.OutOfPages = sub
        error = portable_error(sub("no free page"))
        assert type(error) is EngineProcessError and isinstance(error, KvgenError)
        assert str(error) == "OutOfPages: no free page"
        assert is_user_error(sub("x")) and not is_user_error(ValueError("x"))
    finally:
        sys.modules.pop(name, None)


def test_the_engine_process_exits_when_the_server_process_is_killed(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        if __name__ == "__main__":
            from kvgen.serve.engine_process import ProcessWorker
            from tests.serve.helpers import table_spec
            w = ProcessWorker(table_spec(), max_pending=4)
            print(w.pid, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert pid_gone(pid, within=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failing_build_raises_the_engines_error_in_the_server():
    from kvgen.engine.errors import EngineError

    started = time.monotonic()
    with pytest.raises(EngineError, match="no model folder at /nowhere"):
        ProcessWorker(EngineSpec("tests.serve.helpers:broken_engine", {"message": "no model folder at /nowhere"}),
                      max_pending=4)
    assert time.monotonic() - started < 60


def test_a_tokenizer_that_cannot_be_sent_is_an_engine_process_error_that_says_what_to_do():
    with pytest.raises(EngineProcessError, match="tokenizer cannot be sent .*--engine-in-process.*build_app"):
        ProcessWorker(EngineSpec("tests.serve.light_engines:unsendable_tokenizer_engine"), max_pending=4)


def test_an_engine_that_does_not_build_within_the_start_timeout_is_stopped():
    started = time.monotonic()
    with pytest.raises(EngineProcessError, match=r"within 1 s \(EngineSpec.start_timeout\)"):
        ProcessWorker(EngineSpec("tests.serve.light_engines:slow_engine", {"seconds": 60}, start_timeout=1.0),
                      max_pending=4)
    assert time.monotonic() - started < 15


def test_the_engine_process_says_it_stopped_even_when_closing_a_broken_engine_fails():
    from kvgen.serve.engine_child import finish

    class Broken:
        def close(self):
            raise OSError("the tensor-parallel ranks are gone")

    class Port:
        sent = []

        def send(self, message):
            self.sent.append(message)

    port = Port()
    finish(Broken(), port)  # the error is printed
    assert port.sent == [("stopped", None)]


def test_a_spec_that_cannot_be_pickled_is_refused_before_a_process_starts():
    with pytest.raises(EngineProcessError, match="module-level function"):
        ProcessWorker(EngineSpec(lambda: None), max_pending=4)
