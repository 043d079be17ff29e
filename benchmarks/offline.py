"""The offline-throughput loop the engine benchmarks share (imports nothing heavy: callers choose the device sync)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def run_offline(engine, requests: Sequence[tuple[list[int], int]], sync: Callable[[], None],
                phases: dict | None = None) -> tuple[int, float]:
    """Queue every ``(prompt ids, output tokens)`` request greedily (no EOS stop), step until all finish.

    Returns ``(generated tokens, seconds)``, timed between two ``sync()`` calls
    so the device's queued work is counted. ``phases``, when given, receives
    the decode-only part of the run: ``decode_steps``, ``decode_tokens`` and
    ``decode_s``, the ``step()`` calls that launched a step of one token for
    every scheduled sequence and nothing else (no prompt chunk; the engine's
    ``num_decode_steps``), each timed from call to return. That is the phase
    a KV-bound batch is bound by: a long prompt's prefill costs the same
    whatever the KV scheme. A synchronous engine's step returns after its
    tokens are read, so its time is the step's. With async scheduling a call
    returns before its step's tokens are read and also waits for the step
    before: the first decode call after a prompt's last chunk also pays for
    that chunk, so measure phases synchronously (the KV-bound benchmark
    does).
    """
    from kvgen.engine import SamplingParams

    engine.stream_text = False
    for prompt, n in requests:
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    sync()
    start = time.perf_counter()
    generated = 0
    dec_steps = dec_tokens = 0
    dec_s = 0.0
    while engine.has_unfinished_requests():
        steps0, tokens0 = (engine.num_decode_steps, engine.num_decode_tokens) if phases is not None else (0, 0)
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        if phases is not None and engine.num_decode_steps > steps0:
            dec_steps += engine.num_decode_steps - steps0
            dec_tokens += engine.num_decode_tokens - tokens0
            dec_s += time.perf_counter() - t
    sync()
    if phases is not None:
        phases.update(decode_steps=dec_steps, decode_tokens=dec_tokens, decode_s=dec_s)
    return generated, time.perf_counter() - start
