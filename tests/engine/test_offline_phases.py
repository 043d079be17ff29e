"""benchmarks.offline.run_offline's decode-phase accounting (the KV-bound benchmark's decode tokens/s)."""

from __future__ import annotations

import random

from benchmarks.offline import run_offline

from .helpers import TableRunner, all_free, fake_engine, stories_cache


def test_decode_phase_counts_exactly_the_decode_only_steps():
    cache = stories_cache(4096)
    runner = TableRunner()
    # a small token budget: prompts take several chunked steps, some mixed with other requests' decodes
    eng = fake_engine(cache, runner, max_num_batched_tokens=24, max_num_seqs=4)
    rng = random.Random(1)
    reqs = [([rng.randrange(64) for _ in range(rng.randint(5, 70))], rng.randint(3, 30)) for _ in range(9)]
    phases: dict = {}
    generated, seconds = run_offline(eng, reqs, lambda: None, phases)
    assert generated == sum(n for _, n in reqs) and seconds > 0
    decode_steps = [batch for batch, _, is_decode in runner.steps if is_decode]
    assert phases["decode_steps"] == len(decode_steps) > 0
    assert phases["decode_tokens"] == sum(decode_steps) < generated  # prompt steps sampled tokens too
    assert 0 < phases["decode_s"] <= seconds
    assert all_free(cache)
