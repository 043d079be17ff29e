"""EngineLoop and its metrics' counts on a real engine (the stand-in model), without a server.

A scripted Port runs one command per loop iteration (an engine step follows
each while requests are unfinished) and keeps what the loop hands over.
``kvgen_request_finished_total`` counts engine requests (one per prompt,
whatever its ``n``): an abort is one per request whether its client left,
a drain's deadline or a stop ended it, and a request taken back because
its HTTP request was refused (400) counts nowhere. A drain hands over
deltas like every step: each request's last output is only what it had
not been sent.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")

from kvgen.engine.sampling_params import SamplingParams  # noqa: E402
from kvgen.serve.engine_loop import EngineLoop, prepare_engine  # noqa: E402
from kvgen.serve.protocol import ApiError  # noqa: E402

from .helpers import table_engine  # noqa: E402


class ScriptPort:
    """Runs ``script[i](loop)`` at the loop's i-th command turn, then stops it; keeps each hand-over."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.items: list[tuple] = []
        self.finished: dict[str, int] = {}

    def wait(self, timeout: float) -> None:
        pass

    def run_commands(self, loop: EngineLoop) -> None:
        if self.script:
            self.script.pop(0)(loop)
        else:
            loop.stop()

    def emit(self, items, stats) -> None:
        self.items += items
        for reason, n in (stats or {}).get("finished", {}).items():
            self.finished[reason] = self.finished.get(reason, 0) + n

    def fail(self, error, request_ids) -> None:
        raise AssertionError(f"the engine failed: {error!r}")


def run_script(engine, *script) -> ScriptPort:
    prepare_engine(engine)
    port = ScriptPort(script)
    loop = EngineLoop(engine, port)
    loop.run()
    assert loop.error is None and not engine.has_unfinished_requests()
    return port


def add(request_ids, prompts, **params):
    return lambda loop: loop.add(request_ids, prompts, SamplingParams(temperature=0, **params), time.perf_counter())


def step(loop):
    pass


def refused_add(loop):
    with pytest.raises(ApiError) as e:  # the second prompt is too long: the first one is taken back
        add(["c-0", "c-1"], [[1, 2, 3], [5] * 300], max_tokens=4)(loop)
    assert e.value.status == 400


def test_aborts_count_one_per_engine_request_however_they_end_and_refused_requests_not_at_all():
    engine = table_engine()
    port = run_script(
        engine,
        add(["a-0", "b-0"], [[1, 2, 3], [4, 5, 6]], n=2, max_tokens=100),
        refused_add,
        step,
        lambda loop: loop.abort(["a-0"]),  # its client went away
        lambda loop: loop.drain(time.monotonic()),  # b-0's two completions are aborted at the deadline
    )
    assert port.finished == {"abort": 2}
    port = run_script(engine, add(["d-0"], [[7, 8]], n=3, max_tokens=100), step)
    assert port.finished == {"abort": 1}  # stopped with its 3 completions running
    port = run_script(engine, add(["e-0"], [[7, 8]], n=2, max_tokens=3), *[step] * 5)
    assert port.finished == {"length": 1}  # its 2 completions ran out of tokens: one request


def test_a_drain_hands_over_only_what_each_request_was_not_sent():
    engine = table_engine()
    port = run_script(engine, add(["a-0"], [[1, 2, 3]], n=2, max_tokens=100, logprobs=2, stop=["never said"]),
                      step, step, step, lambda loop: loop.drain(time.monotonic()))
    rid, last, finished = port.items[-1]
    assert rid == "a-0" and finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert all(c.token_ids == [] and c.text for c in last.outputs)  # the held-back text only: no tokens again
    for index in (0, 1):
        got = [c for _, out, _ in port.items for c in out.outputs if c.index == index]
        tokens = [t for c in got for t in c.token_ids]
        assert len(tokens) >= 4 and sum(len(c.logprobs) for c in got) == len(tokens)
        assert "".join(c.text for c in got) == engine.tokenizer.decode(tokens, skip_special_tokens=True)
