"""Shared pieces of the server tests: an engine with a stand-in model on a real KVCache, and a server thread.

The stand-in (``tests.engine.helpers.TableRunner``: next token = a table row of
the last token) lets load tests run hundreds of requests: the interpreter
would take about a second of CPU per sequence and step with the real
stories260K. The KV cache underneath is the real runtime, so every page a
request reserves, forks, preempts or frees goes through the BlockManager.
Tests that compare outputs with ``LLM.generate`` use the real model.

Both worker kinds are served: ``"thread"`` (the engine built here, on a
thread of the server) and ``"process"`` (an :class:`EngineSpec` naming a
factory of this module: the engine is built in its own process, as
``kvgen serve`` runs it). Code run on the engine (``ServerThread.on_engine``)
is a module-level function of the engine, so it reaches either.
"""

from __future__ import annotations

import os
import threading
import time
import types

from ..engine.helpers import STORIES, TableRunner, all_free, stories_cache  # noqa: F401 -- re-exported

from kvgen.serve.app import build_app
from kvgen.serve.engine_process import EngineSpec
from kvgen.serve.server import bind, make_server
from kvgen.serve.stats import kv_pages

KINDS = ("thread", "process")

MODEL = "stories"


FIRST_PIECE = 259
"""stories260K's ids below this are specials and byte-fallback tokens (<0x00>..<0xFF>)."""


class SlowTableRunner(TableRunner):
    """TableRunner whose every step takes ``delay`` seconds (so requests stay running while a test acts).

    It never emits specials or byte tokens: random byte runs are invalid
    UTF-8, whose decoding changes as bytes arrive (a real model's bytes form
    characters); the server streams text exactly for valid UTF-8.
    """

    def __init__(self, delay: float, vocab: int = 512) -> None:
        super().__init__(vocab=vocab)
        self.table[:, :FIRST_PIECE] -= 1e4
        self.delay = delay

    def run(self, step, input_ids, positions, sample_rows):
        time.sleep(self.delay)
        return super().run(step, input_ids, positions, sample_rows)


def table_engine(*, delay: float = 0.0, max_num_seqs: int = 16, max_tokens: int = 4096, max_model_len: int = 256):
    """An LLMEngine with the stories260K tokenizer, a stand-in model (vocab 512) and a real fp32 KVCache."""
    from transformers import AutoTokenizer

    from kvgen.engine.engine import LLMEngine

    cache = stories_cache(max_tokens, max_seqs=max_num_seqs)
    tok = AutoTokenizer.from_pretrained(STORIES)
    return LLMEngine(SlowTableRunner(delay), cache, tok, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=256, eos_token_ids=(), vocab_size=512)


def table_spec(**kwargs) -> EngineSpec:
    """:func:`table_engine` with ``kwargs``, built in the engine process."""
    return EngineSpec(table_engine, kwargs)


def reference():
    """The stand-in's runner (same table: seed 0) and tokenizer, for expected outputs when the engine is elsewhere."""
    from transformers import AutoTokenizer

    return types.SimpleNamespace(runner=SlowTableRunner(0.0), tokenizer=AutoTokenizer.from_pretrained(STORIES))


def broken_engine(message: str):
    """An engine factory that fails as a bad model path does."""
    from kvgen.engine.errors import EngineError

    raise EngineError(message)


def set_delay(engine, delay: float) -> None:
    """Run on the engine: each step of the stand-in now takes ``delay`` seconds."""
    engine.runner.delay = delay


def pid_gone(pid: int, within: float = 0.0) -> bool:
    """Whether process ``pid`` no longer exists (waiting up to ``within`` seconds for it to go)."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def engine_pages(engine) -> dict[str, int]:
    """Run on the engine: :func:`kv_pages` of its cache."""
    return kv_pages(engine.cache)


def engine_all_free(engine) -> bool:
    return all_free(engine.cache)


def engine_sleep(engine, seconds: float) -> None:
    """Run on the engine: hold it ``seconds`` (as a step or call that hangs would)."""
    time.sleep(seconds)


FOREIGN = "kvgen_generated_serve_test"
"""A module made only in the engine process (as a generated package is): the server's process cannot import it."""


def foreign_class(base: type) -> type:
    """A subclass of ``base`` in the module :data:`FOREIGN`, created in (and importable from) this process only."""
    import sys

    module = sys.modules.setdefault(FOREIGN, types.ModuleType(FOREIGN))
    name = f"Foreign{base.__name__}"
    cls = getattr(module, name, None)
    if cls is None:
        cls = type(name, (base,), {"__module__": FOREIGN, "__qualname__": name})
        setattr(module, name, cls)
    return cls


def foreign_result(engine):
    """Run on the engine: an object of a class the server process cannot unpickle."""
    return foreign_class(object)()


def foreign_error(engine, user: bool):
    """Run on the engine: raise an error of a class the server process cannot import (a KvgenError when ``user``)."""
    from kvgen.errors import KvgenError

    raise foreign_class(KvgenError if user else ValueError)("out of pages; free a sequence")


class ServerThread:
    """``kvgen serve``'s app on 127.0.0.1 (a free port) in a thread of this process; a context manager.

    ``engine``: an engine (served on a thread) or an EngineSpec (served from
    its own process). ``ref`` has the engine's ``runner`` and ``tokenizer``
    (the engine itself, or :func:`reference` when it is in another process).
    Leaving it drains and stops the server as SIGTERM would; ``summary`` is
    then what the engine held at shutdown (requests, pages used, sequences).
    """

    def __init__(self, engine, drain_timeout: float = 10.0, **app_kwargs) -> None:
        self.engine = None if isinstance(engine, EngineSpec) else engine
        self.ref = reference() if self.engine is None else engine
        self.app = build_app(engine, model_name=MODEL, drain_timeout=drain_timeout, **app_kwargs)
        self.server = make_server(self.app, drain_timeout=drain_timeout)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def worker(self):
        return self.app.state.serve.worker

    @property
    def summary(self):
        return self.app.state.serve.stopped_summary

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.request_exit()
        self.thread.join(60)

    def on_engine(self, fn, *args):
        """``fn(engine, *args)`` run where the engine runs, between two steps; returns its result."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(self.worker.call(fn, *args), self.worker.loop).result(60)

    def pages(self) -> dict:
        """The cache's page counts (BlockManager), read on the engine."""
        return self.on_engine(engine_pages)

    def all_free(self) -> bool:
        """No sequence in the cache and every page of every pool free (read on the engine)."""
        return self.on_engine(engine_all_free)


def metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with labels, as printed) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
