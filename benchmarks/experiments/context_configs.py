"""Experiment: does a decode config tuned at a graph's longest context serve shorter contexts well?

The engine captures one decode graph per batch bucket and gives it the runtime's config for that batch at
the graph's longest context (``kvgen/engine/graphs.py``); the tuner times candidates on full sequences of
that length. Issue 14's B=1 step runs at 16K tokens in graphs sized for 32K. This times every candidate
of each backend at both lengths (graph replays over cold pages, as the tuner does) and prints, per scheme
and backend, the best config at each length and what the 32K winner costs at 16K.

    python -m benchmarks.experiments.context_configs [--schemes bf16,int4] [--batch 1] [--lengths 16384,32768]
        [--heads 32,8] [--backends triton,cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from benchmarks.cuda_decode import _compile, cache_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="bf16,int4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lengths", default="16384,32768", help="the contexts timed; the longest sizes the cache")
    ap.add_argument("--heads", default="32,8", help="query,KV heads (Llama-3-8B's by default)")
    ap.add_argument("--backends", default="triton,cuda", help="which of the auto package's variants to time")
    ap.add_argument("--out", default="/tmp/context_configs.json")
    args = ap.parse_args(argv)
    from kvgen.runtime.kernel_timer import graph_time_ms

    B = args.batch
    lengths = sorted(int(x) for x in args.lengths.split(","))
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            pkg, _, _ = _compile(scheme, "auto", B, lengths[-1], Hq, Hkv, 128, tmp)
            cache = pkg.load(device="cuda", max_tokens=cache_tokens(B, lengths[-1]), num_layers=1, max_seqs=B)
            for backend, mod in pkg.KERNEL_VARIANTS["decode"].items():
                if backend not in args.backends.split(","):
                    continue
                cands = mod.candidates(B, lengths[-1])
                times = {L: [] for L in lengths}
                for L in lengths:
                    for cfg in cands:
                        try:
                            ms = graph_time_ms(cache._bench("decode", (B, L), cfg, module=mod, exact=True))
                        except Exception as e:  # a config the device cannot run (shared memory): skipped
                            ms = None
                            print(f"  {scheme} {backend} {cfg}: {type(e).__name__}: {e}", file=sys.stderr)
                        times[L].append(ms)
                    cache.__dict__.pop("_bench_inputs", None)
                if any(all(t is None for t in times[L]) for L in lengths):
                    print(f"{scheme} {backend}: no candidate ran at some length (above)", flush=True)
                    continue
                best = {L: min((t, i) for i, t in enumerate(times[L]) if t is not None) for L in lengths}
                long_i = best[lengths[-1]][1]
                rec = {"scheme": scheme, "backend": backend, "B": B, "Hq": Hq, "Hkv": Hkv,
                       "candidates": cands, "ms": {str(L): times[L] for L in lengths},
                       "best": {str(L): {"config": cands[i], "ms": t} for L, (t, i) in best.items()},
                       "longest_winner_at": {str(L): times[L][long_i] for L in lengths}}
                records.append(rec)
                line = ", ".join(f"{L}: best {t:.4f} ms {cands[i]}; {lengths[-1]}-winner {times[L][long_i]:.4f} ms"
                                 for L, (t, i) in best.items())
                print(f"{scheme} {backend}: {line}", flush=True)
            del cache
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
