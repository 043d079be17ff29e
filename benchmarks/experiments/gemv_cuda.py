"""Experiment: kvgen's CUDA GEMV (kvgen.engine.gemv) against cuBLAS for a decode step's few rows.

The projections of a Llama-3-8B layer (q/k/v, o, gate/up, down) and the LM head, bf16, at 1, 2 and 4 rows;
each timed from a CUDA graph cycling over 8 weight copies (cold in L2, as in a model's step; the runtime's
graph timer), with every GEMV config checked against a float64 reference first. Reports ms per call and the
fraction of the copy bandwidth (measured in the same process) its weight bytes reach.

    python -m benchmarks.experiments.gemv_cuda [--out FILE.json] [--rows 1,2,4] [--source LABEL=PATH ...]

``--source`` adds another build of the kernel (a variant of ``kvgen/engine/gemv.cu`` with the same C entry
point and ABI), timed beside the committed one in the same process; its configs are labelled ``LABEL0``...
(the committed source's ``gemv0``...). The runs alternate over ``--rounds`` (best kept), so a drift of the
GPU's clocks does not favour one source.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
COPIES = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gemv_cuda.json")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--source", action="append", default=[], metavar="LABEL=PATH",
                    help="another gemv.cu to time beside the committed one (repeatable)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    from benchmarks.run import copy_bandwidth
    from kvgen.engine import gemv
    from kvgen.runtime.kernel_timer import cycling, graph_time_ms

    sources = {"gemv": gemv.SOURCE}
    for spec in args.source:
        label, _, path = spec.partition("=")
        if not label or not path or not Path(path).is_file() or label in sources or label == "cublas":
            raise SystemExit(f"--source takes LABEL=PATH with a new label and an existing file, got {spec!r}")
        sources[label] = Path(path).resolve()

    @contextlib.contextmanager
    def built_from(source):
        # gemv.gemv builds and launches gemv.SOURCE: point it at the variant for the calls (and captures) inside
        # (None: cuBLAS, nothing to point)
        saved, gemv.SOURCE = gemv.SOURCE, source or gemv.SOURCE
        try:
            yield
        finally:
            gemv.SOURCE = saved

    bw = copy_bandwidth()
    records = []
    for name, (N, K) in SHAPES.items():
        copies = 1 if name == "lm_head" else COPIES
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ws[0].double().t()
            rec = {"name": name, "N": N, "K": K, "rows": m, "bytes": N * K * 2}
            runs = {"cublas": (None, torch.nn.functional.linear)}
            for label, source in sources.items():
                for c in range(len(gemv.CONFIGS)):
                    runs[f"{label}{c}"] = (source, lambda x, w, c=c: gemv.gemv(x, w, None, c))
            best: dict[str, float] = {}
            errs: dict[str, float] = {}
            for _ in range(max(1, args.rounds)):
                for label, (source, f) in runs.items():
                    with built_from(source):
                        errs[label] = float((f(x, ws[0]).double() - ref).norm() / ref.norm())
                        ms = graph_time_ms(cycling(ws, lambda w, f=f: f(x, w)))
                    best[label] = min(ms, best.get(label, ms))
            line = [f"{name:8s} N={N:6d} K={K:5d} m={m}"]
            for label, ms in best.items():
                rec[label] = {"ms": ms, "bw": rec["bytes"] / (ms * 1e-3) / bw, "rel_l2": errs[label]}
                line.append(f"{label} {ms * 1e3:6.1f} us ({rec[label]['bw']:.2f}, {errs[label]:.1e})")
            records.append(rec)
            print("  ".join(line), flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "copy_bandwidth": bw,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "command": "python -m benchmarks.experiments.gemv_cuda " + " ".join(sys.argv[1:]),
                   "configs": list(gemv.CONFIGS), "sources": {k: str(v) for k, v in sources.items()},
                   "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
