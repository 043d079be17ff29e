"""Many random geometries of the CUDA decode through the CPU emulation (tests/cuda_emu), no GPU needed.

    python -m benchmarks.experiments.cuda_emu_sweep --seeds 100:300 [--out FILE.jsonl]

Each seed draws a case as ``test_cuda_decode_random_geometries`` does (``_random_case``: scheme, head dim, GQA
group, page size, window, softcap, config, ragged lengths) and checks it as that test does (``decode``: a poisoned
cache and output, the float64 reference, the scheme's tolerance); CI runs seeds 0-11, this runs as many as asked
and records every case, passed or not, one JSON line each, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="100:160", help="START:STOP of the seeds to draw")
    ap.add_argument("--out", help="also write the JSON lines here")
    args = ap.parse_args(argv)
    from tests.kernels.test_cuda_decode import Runner, _random_case, decode

    start, stop = (int(x) for x in args.seeds.split(":"))
    runner = Runner("emulated")
    lines, failed = [], 0
    for seed in range(start, stop):
        spec, config, lengths = _random_case(seed)
        rec = {"seed": seed, "scheme": spec.scheme, "head_dim": spec.head_dim, "gqa": spec.gqa_group,
               "page": spec.page_size, "dtype": spec.compute_dtype, "kv_heads": spec.num_kv_heads,
               "window": spec.sliding_window, "softcap": spec.softcap, "config": config, "lengths": lengths}
        t0 = time.perf_counter()
        try:
            decode(runner, spec.scheme, spec.head_dim, spec.gqa_group, spec.page_size, spec.compute_dtype,
                   spec.num_kv_heads, lengths, config=config, window=spec.sliding_window, softcap=spec.softcap,
                   q_scale=2.0, seed=seed)
            rec["ok"] = True
        except (AssertionError, RuntimeError) as exc:
            rec["ok"], rec["error"] = False, str(exc).splitlines()[0][:300]
            failed += 1
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        lines.append(json.dumps(rec))
        print(lines[-1], flush=True)
    summary = json.dumps({"cases": stop - start, "failed": failed})
    print(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines + [summary]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
