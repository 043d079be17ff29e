"""Decode launches for Nsight Compute, and a summary of its reports: what bounds each scheme (issue 16).

Three steps (``bash benchmarks/gpu_session.sh ncu`` runs them): tune the bucket once, outside the profiler;
run a few decode steps under ``ncu``, which profiles one launch of the attention kernel; summarize::

    python -m benchmarks.experiments.ncu_decode run --scheme int4 --backend cuda --work /tmp/ncu --tune
    ncu --clock-control none --target-processes all -k 'regex:^_?decode_kernel' --launch-skip 2 \\
        --launch-count 1 --section SpeedOfLight ... --csv --page raw \\
        python -m benchmarks.experiments.ncu_decode run --scheme int4 --backend cuda --work /tmp/ncu > int4.csv
    python -m benchmarks.experiments.ncu_decode summary int4.csv bf16.csv ...

``run`` compiles a one-layer package of the scheme (``--backend triton|cuda``) at one shape (default the first
ANCHORS shape: B=32, L=4096, 64/8 heads, D=128) under ``--work`` (the same folder every time, so a second process
finds the package and the tuned winner), fills it with random K/V and launches ``cache.decode`` ``--launches``
times at the runtime's config for the bucket: the tuned winner after a ``--tune`` run, else the autotuner's model
(``--config`` names one instead). It prints nothing on stdout (ncu's CSV goes there); the config goes to stderr.
``summary`` reads ncu's raw CSV pages and prints, per file, the kernel's time, registers, occupancy, DRAM and
issue utilization, DRAM bytes a second, how long the busiest SM sat empty, the busiest pipes and the main warp
stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats",
            "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "InstructionStats")
"""The ncu sections ``gpu_session.sh ncu`` asks for (one replay pass each group; no source counters)."""

# summary columns: (label, regex over ncu's raw metric names); the first match is shown
FIELDS = (
    ("kernel", r"^Kernel Name$"),
    ("time_us", r"^gpu__time_duration\.sum$"),
    ("regs", r"^launch__registers_per_thread$"),
    ("smem_B", r"^launch__shared_mem_per_block_dynamic$"),
    ("grid", r"^launch__grid_size$"),
    ("block", r"^launch__block_size$"),
    ("occ_theory_%", r"^sm__maximum_warps_per_active_cycle_pct$"),
    ("occ_achieved_%", r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$"),
    # ncu names it dram__throughput on the H200 and gpu__dram_throughput on the H100
    ("dram_%", r"^(gpu__)?dram_?_throughput\.avg\.pct_of_peak_sustained_elapsed$"),
    ("sm_%", r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$"),
    ("issue_active_%", r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$"),
    ("cycles_per_issue", r"^smsp__average_warp_latency_per_inst_issued\.ratio$"),
)
PIPES = re.compile(r"^sm__(inst_executed_)?pipe_(?P<pipe>[a-z0-9_]+?)(_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
STALLS = re.compile(r"^smsp__average_warps?_(latency_)?issue_stalled_(?P<reason>[a-z_]+?)_per_issue_active\.ratio$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def read_raw(path: str) -> list[dict[str, str]]:
    """The kernel rows of an ``ncu --csv --page raw`` output (its header row, a units row, then one row per
    profiled kernel); lines the profiler or the program printed around them are skipped."""
    return _read(path)[1]


def _read(path: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(metric -> unit, kernel rows) of an ``ncu --csv --page raw`` output."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return {}, []
    header = rows[0]
    return dict(zip(header, rows[1])), [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
              "second": 1e6}
"""ncu's duration units in µs (its raw page reports kernel times in whichever it picks: "ns" on the H200)."""


def _derived(row: dict[str, str]) -> list[str]:
    """DRAM bytes a second (TB/s) and the share of the launch's elapsed cycles the busiest SM held no warp
    (launch, first blocks' start, last blocks' end: what no tile loop can shorten), where ncu reported them."""
    out = []
    tbps = _number(row.get("dram__bytes.sum.per_second", ""))
    if tbps is not None:
        out.append(f"dram_TBps={tbps / 1e12:.2f}")
    elapsed = _number(row.get("gpc__cycles_elapsed.max", ""))
    active = _number(row.get("sm__cycles_active.max", ""))
    if elapsed and active is not None:
        out.append(f"busiest_sm_idle_%={100 * (1 - active / elapsed):.1f}")
    return out


def summarize(path: str) -> str:
    """One block of text per profiled kernel of ``path``."""
    out = []
    units, rows = _read(path)
    for row in rows:
        parts = [os.path.basename(path)]
        for label, pattern in FIELDS:
            rx = re.compile(pattern)
            key = next((k for k in row if rx.match(k)), None)
            if key is None:
                continue
            value = row[key]
            if label == "time_us" and _number(value) is not None and units.get(key) in TIME_UNITS:
                value = f"{_number(value) * TIME_UNITS[units[key]]:.2f}"
            parts.append(f"{label}={value[:60]}")
        pipes = sorted(((m.group("pipe"), _number(v)) for k, v in row.items() if (m := PIPES.match(k))
                        and _number(v) is not None), key=lambda kv: -kv[1])
        stalls = sorted(((m.group("reason"), _number(v)) for k, v in row.items() if (m := STALLS.match(k))
                         and _number(v) is not None), key=lambda kv: -kv[1])
        parts += _derived(row)
        out.append("  ".join(parts))
        out.append("  pipes (% of peak, active cycles): " + ", ".join(f"{p} {v:.1f}" for p, v in pipes[:6]))
        total = sum(v for _, v in stalls) or 1.0
        out.append("  stalls (cycles per issued instruction): "
                   + ", ".join(f"{r} {v:.2f} ({100 * v / total:.0f}%)" for r, v in stalls[:7]))
    return "\n".join(out) if out else f"{os.path.basename(path)}: no kernel rows (did ncu profile anything?)"


def run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.cuda_decode import _compile, filled_cache

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shape = tuple(int(x) for x in args.shape.split(","))
    B, L, Hq, Hkv, D = shape
    os.environ.setdefault("KVGEN_CACHE_DIR", os.path.join(args.work, "cache"))
    # No warm-up at load: its decode launches (small scratch shapes) would be the ones ncu profiles.
    os.environ["KVGEN_WARMUP"] = "0"
    pkg, _, res = _compile(args.scheme, args.backend, B, L, Hq, Hkv, D, os.path.join(args.work, "pkgs"))
    runs = getattr(pkg.KERNELS["decode"], "BACKEND", "triton")
    if runs != args.backend:
        print(f"{args.scheme}: the decode kernel is {runs}, not {args.backend} ({res.notes})", file=sys.stderr)
        return 2
    cache, q, rt = filled_cache(pkg, shape, 0, os.path.join(args.work, "tune"))
    if args.tune:
        rec = rt.tune(cache, [(B, L)], ops=("decode",))[0]
        print(f"{args.scheme} {args.backend}: tuned {rec['key']} -> {rec['config']} ({rec['ms']} ms)", file=sys.stderr)
        return 0
    if args.config:  # a config of the caller's instead of the runtime's (the tuned winner or the model's)
        cache.step.configs["decode"] = json.loads(args.config)
    print(f"{args.scheme} {args.backend}: config {cache.step.configs.get('decode')}", file=sys.stderr)
    out = torch.empty_like(q)
    for _ in range(args.launches):
        cache.decode(0, q, None, out=out)
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch one scheme's decode (under ncu), or --tune its bucket first")
    r.add_argument("--scheme", required=True)
    r.add_argument("--backend", choices=("triton", "cuda"), default="cuda")
    r.add_argument("--shape", default="32,4096,64,8,128", help="B,L,Hq,Hkv,D")
    r.add_argument("--work", default="/tmp/kvgen-ncu", help="packages, build cache and tuned winners")
    r.add_argument("--launches", type=int, default=4)
    r.add_argument("--config", help='profile this config, e.g. \'{"num_splits": 1, "num_warps": 8, "depth": 2}\'')
    r.add_argument("--tune", action="store_true", help="tune the bucket (kvgen tune's path) and stop")
    s = sub.add_parser("summary", help="summarize ncu --csv --page raw outputs")
    s.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "summary":
        print("\n".join(summarize(f) for f in args.files))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
