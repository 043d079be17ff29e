"""Host time of one engine decode step at long contexts, without a GPU (CPU, Triton interpreter).

    TRITON_INTERPRET=1 python -m benchmarks.experiments.host_step_profile [--batch 12] [--context 32768]
                                                                         [--waiting 4] [--retry-every-step]

A table-lookup model (tests/engine/helpers.py ``TableRunner``: the next token
depends only on the last) over stories260K's real KV cache (fp32 pages, page
16): ``--batch`` sequences of ``--context`` prompt tokens run, ``--waiting``
more wait for pages (the cache holds the batch and little more). After the
prompts are in, it times 200 decode steps (median ms per step, without the
profiler), then profiles 20 and prints the cProfile entries by cumulative time. ``--retry-every-step`` restores the
scheduler's behaviour before c64bb93 (the waiting head offered to the cache
at every step) to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--waiting", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="steps profiled (after the timed ones)")
    ap.add_argument("--timed-steps", type=int, default=200, help="steps timed without the profiler")
    ap.add_argument("--retry-every-step", action="store_true")
    args = ap.parse_args(argv)

    from kvgen.engine import SamplingParams
    from kvgen.engine import scheduler
    from tests.engine.helpers import TableRunner, fake_engine, stories_cache

    if args.retry_every_step:
        scheduler.Scheduler._block = lambda self, head: None
    B, L = args.batch, args.context
    cache = stories_cache(B * (L + 600), max_seqs=B + args.waiting)
    eng = fake_engine(cache, TableRunner(), max_model_len=L + 600, max_num_seqs=B + args.waiting,
                      max_num_batched_tokens=8192)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.timed_steps + args.steps + 100, ignore_eos=True)
    for _ in range(B + args.waiting):
        eng.add_request(None, [rng.randrange(64) for _ in range(L)], params)
    while eng.num_decode_steps < 3:
        eng.step()
    print(f"running {len(eng.scheduler.running)}, waiting {len(eng.scheduler.waiting)}, "
          f"retry every step: {args.retry_every_step}")
    # timed without the profiler (which slows Python calls several-fold), then profiled
    times = []
    for _ in range(args.timed_steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"host ms per decode step: {times[len(times) // 2] * 1e3:.3f} median of {len(times)} "
          f"(quartiles {times[len(times) // 4] * 1e3:.3f}-{times[3 * len(times) // 4] * 1e3:.3f}), no profiler")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
