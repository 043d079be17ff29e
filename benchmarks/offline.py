"""The offline-throughput loop the engine benchmarks share (imports nothing heavy: callers choose the device sync)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def run_offline(engine, requests: Sequence[tuple[list[int], int]], sync: Callable[[], None]) -> tuple[int, float]:
    """Queue every ``(prompt ids, output tokens)`` request greedily (no EOS stop), step until all finish.

    Returns ``(generated tokens, seconds)``, timed between two ``sync()`` calls
    so the device's queued work is counted.
    """
    from kvgen.engine import SamplingParams

    engine.stream_text = False
    for prompt, n in requests:
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    sync()
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    sync()
    return generated, time.perf_counter() - start
