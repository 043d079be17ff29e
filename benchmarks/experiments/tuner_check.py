"""Whether the runtime's tuned decode config is the fastest one: every config timed, then the tuner's own pick.

``benchmarks.run --backend auto`` times each scheme at the config the
runtime's autotuner picks (``runtime_choice``). Where that time is well above
the best candidate's in ``decode_variants time`` (the same kernel, the same
cold timer), either the tuner timed other configs than the best (its ranked
list: ``autotune_model.ranked_candidates``) or its timings differ from a
later timing of the same config. This prints, per scheme and shape:

- every config of the module's ``candidates`` and of the tuner's ranked list,
  timed by ``benchmarks.run``'s graph timer on one case (sorted);
- each config the tuner timed, with its own ms, in its order (its front-runners twice: the second readings
  are autotune's confirmation, ``CONFIRM_WITHIN``);
- the config it chose and that config timed again, by both of benchmarks.run's timers, and by the graph timer
  after the GPU sat idle for ``IDLE_S`` seconds (since 2026-12-05 that timer warms up after an idle gap and
  benchmarks.run takes the fastest of three rounds, so this reading no longer shows a slow start:
  ``placement_timing``'s ``first`` does).

Usage (on a GPU): ``python -m benchmarks.experiments.tuner_check --schemes int8,int4 --shapes 1x131072,32x4096
[--backend cuda] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time

from benchmarks.experiments.records import write_records

IDLE_S = 3.0


def check(scheme_name: str, B: int, L: int, Hq: int, Hkv: int, D: int, backend: str) -> dict:
    import torch

    from benchmarks.decode_timing import DecodeTimer
    from benchmarks.run import DecodeCase, kernel_module
    from kvgen.runtime.autotune import Autotuner, default_timer
    from kvgen.runtime.autotune_keys import bucket
    from kvgen.runtime.autotune_model import ranked_candidates

    mod, scheme = kernel_module("decode", scheme_name, Hkv, Hq // Hkv, D, backend=backend)
    case = DecodeCase(scheme, B, L, Hq, Hkv, D)
    out = torch.empty_like(case.q)
    dt = DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0]))
    sm = 1 / math.sqrt(D)

    def launch(cfg, pools, tables):
        mod.launch(case.q, out, pools, tables, case.seq_lens, case.num_compressed, sm, cfg)

    tuned_order = []  # (config, ms) as the tuner times them

    def recording_timer(fn):
        ms = default_timer(fn)
        tuned_order.append((dict(fn.config), ms))
        return ms

    def make_bench(cfg):
        fn = dt.cold_call(launch, cfg)
        fn.config = cfg
        return fn

    with tempfile.TemporaryDirectory(prefix="kvgen-tuner-check-") as tmp:
        tuner = Autotuner(torch.device("cuda"), mode="sync", progress=False, directory=tmp, timer=recording_timer)
        chosen = tuner.config("decode", mod, (B, L), make_bench)
        ranked = ranked_candidates("decode", mod, tuple(bucket(n) for n in (B, L)), tuner.sms, tuner.max_candidates)
    every = {json.dumps(c, sort_keys=True): c for c in [*mod.candidates(B, L), *ranked]}
    timed = sorted(((dt.ms(launch, c), c) for c in every.values()), key=lambda t: t[0])
    both = dt.both(launch, chosen)  # as benchmarks.run times the winner: its graph and do_bench ms
    again = both["graph"]
    # and once more after the GPU sat idle (as it does while benchmarks.run builds a case): a timing that starts at
    # a lowered clock reads slower
    time.sleep(IDLE_S)
    after_idle = dt.ms(launch, chosen)
    rec = {"scheme": scheme_name, "B": B, "L": L, "heads": [Hq, Hkv], "head_dim": D, "backend": backend,
           "every": [[ms, c] for ms, c in timed], "tuner_timed": [[ms, c] for c, ms in tuned_order],
           "chosen": chosen, "chosen_ms_again": again, "chosen_ms_do_bench": both["do_bench"],
           "chosen_ms_after_idle": after_idle, "idle_s": IDLE_S,
           "best": timed[0][1], "best_ms": timed[0][0]}
    print(f"{scheme_name} B={B} L={L}: chosen {chosen} {again * 1e3:.1f} us (do_bench {both['do_bench'] * 1e3:.1f}, "
          f"after {IDLE_S:g} s idle {after_idle * 1e3:.1f}); "
          f"best {timed[0][1]} {timed[0][0] * 1e3:.1f} us (x{again / timed[0][0]:.3f})", flush=True)
    print("  tuner timed: " + ", ".join(f"{c['num_splits']}/{c.get('num_warps')}/{c.get('depth')} {ms * 1e3:.1f}"
                                         for c, ms in tuned_order), flush=True)
    print("  every:       " + ", ".join(f"{c['num_splits']}/{c.get('num_warps')}/{c.get('depth')} {ms * 1e3:.1f}"
                                         for ms, c in timed), flush=True)
    return rec  # the case goes with this frame; main empties the cache between cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="int8,int4")
    p.add_argument("--shapes", default="1x131072,32x4096")
    p.add_argument("--heads", default="64,8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    Hq, Hkv = (int(x) for x in a.heads.split(","))
    records = []
    for s in a.schemes.split(","):
        for shape in a.shapes.split(","):
            B, L = (int(x) for x in shape.split("x"))
            records.append(check(s, B, L, Hq, Hkv, a.head_dim, a.backend))
            torch.cuda.empty_cache()
            if a.out:  # rewritten after each record: a cut run keeps what it measured
                write_records(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
