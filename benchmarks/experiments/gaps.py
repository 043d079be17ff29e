"""Experiment: measurements behind the issue-5 goals that the tuned kernels still miss.

    python -m benchmarks.experiments.gaps write|decode64|all [--out DIR]

``write``: the 4096-token cache write (B=4096 tokens, 8 KV heads, D=128,
bf16 input, page 16) next to what the *same number of bytes* costs a plain
``torch`` device copy and ``index_copy_`` -- the ceiling a kernel of that
size has, launch and ramp included -- and the same write at 32768 tokens
(steady state), each timed with ``do_bench`` and with ``do_bench_cudagraph``
(no launch gaps, but the L2 stays warm between replays). Question: is the 0.60-of-copy-bandwidth goal missed by
the kernel or by the size of the transfer?

``decode64``: the D=64 anchor shape (B=16, L=8192, 32/4 heads) against the
same bytes at D=128 (B=16, L=4096, 32/4) and at 8 KV heads (B=8, L=8192,
64/8, D=64), best of ``decode.candidates()`` each, then a wider grid at D=64
(tokens per tile {32..256} x warps {2, 4, 8} x stages {2, 3, 4} x splits).
Question: which of head dim, KV-head count or config grid makes that shape
read at a third of copy bandwidth?

Prints one line per measurement and writes DIR/gaps.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks import run as bench_run
from benchmarks import run_other_ops

PAGE = 16


def bench_graph(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def write_part(copy_bw, emit):
    Hkv, D = 8, 128
    for N in (4096, 32768):
        # The ceiling for this many bytes: a plain copy of the bytes the bf16 write reads (it writes as many).
        src = torch.randn(N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty(2 * N, Hkv, D, device="cuda", dtype=torch.bfloat16)
        both = torch.cat([src, src])
        nbytes = 2 * 2 * src.numel() * src.element_size()
        ms = bench_run.bench(lambda: dst.copy_(both))
        emit(dict(part="write", what="torch copy, same bytes as the bf16 write", N=N, ms=ms, bytes=nbytes,
                  bw=nbytes / (ms * 1e-3) / copy_bw))
        idx = torch.randperm(2 * N, device="cuda")
        ms = bench_run.bench(lambda: dst.index_copy_(0, idx, both))
        emit(dict(part="write", what="torch index_copy_, same bytes", N=N, ms=ms, bytes=nbytes,
                  bw=nbytes / (ms * 1e-3) / copy_bw))
        del src, dst, both
        for name in ("bf16", "int8", "fp8", "int4"):
            mod, scheme = bench_run.kernel_module("cache_write", name, Hkv, 8, D)
            k, v, pools, slots, nb = run_other_ops.write_case(scheme, N, Hkv, D)
            for cfg in (None, {"tokens_per_program": 8, "num_warps": 4}, {"tokens_per_program": 16, "num_warps": 4}):
                fn = lambda: mod.launch(k, v, pools, slots, config=cfg)  # noqa: E731
                ms = bench_run.bench(fn)
                gms = bench_graph(fn)
                emit(dict(part="write", what=f"kvgen {name} {cfg or 'default'}", N=N, ms=ms, graph_ms=gms, bytes=nb,
                          bw=nb / (ms * 1e-3) / copy_bw, graph_bw=nb / (gms * 1e-3) / copy_bw))
            del pools, k, v
            torch.cuda.empty_cache()


def _decode_case(name, shape):
    B, L, Hq, Hkv, D = shape
    mod, scheme = bench_run.kernel_module("decode", name, Hkv, Hq // Hkv, D)
    return mod, bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)


def _decode_run(mod, case, out):
    """``run(cfg)``: one decode launch of ``case`` into ``out`` with launch config ``cfg``."""
    sm = 1 / math.sqrt(case.D)
    return lambda cfg: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed,
                                  sm, cfg)


def decode64_part(copy_bw, emit, deadline):
    shapes = {"anchor D64 32/4": (16, 8192, 32, 4, 64), "same bytes D128 32/4": (16, 4096, 32, 4, 128),
              "same bytes D64 64/8": (8, 8192, 64, 8, 64)}
    for label, shape in shapes.items():
        for name in (("bf16", "fp8") if label.startswith("anchor") else ("bf16",)):
            if time.time() > deadline:
                return
            mod, case = _decode_case(name, shape)
            sdpa = bench_run.sdpa_decode_ms(case) if name == "bf16" else None
            run = _decode_run(mod, case, torch.empty_like(case.q))
            ms, cfg, _ = bench_run.best_config(mod, run, shape[0], shape[1])
            emit(dict(part="decode64", what=f"{label} {name} best of candidates", shape=shape, ms=ms, cfg=cfg,
                      bytes=case.bytes, bw=case.bytes / (ms * 1e-3) / copy_bw, sdpa_ms=sdpa))
            ms_g = bench_graph(lambda: run(cfg))
            emit(dict(part="decode64", what=f"{label} {name} same config, cuda graph", shape=shape, ms=ms_g, cfg=cfg,
                      bytes=case.bytes, bw=case.bytes / (ms_g * 1e-3) / copy_bw))
            del case
            torch.cuda.empty_cache()
    # Wider grid at the anchor shape, bf16 (compiled variants first, splits are a runtime argument).
    shape = shapes["anchor D64 32/4"]
    mod, case = _decode_case("bf16", shape)
    ref = case.reference()
    out = torch.empty_like(case.q)
    run = _decode_run(mod, case, out)
    rows = []
    for tokens in (32, 64, 128, 256):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                for splits in (5, 10, 20, 40):
                    if time.time() > deadline:
                        break
                    cfg = {"num_splits": splits, "pages_per_tile": tokens // PAGE, "num_warps": warps, "num_stages": stages}
                    try:
                        ms, err = bench_run.checked_time(lambda: run(cfg), out, ref)
                    except Exception as exc:  # shared memory / registers: skip
                        print(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
                        continue
                    rows.append(dict(cfg=cfg, ms=ms, err=err, bw=case.bytes / (ms * 1e-3) / copy_bw))
    rows.sort(key=lambda r: r["ms"])
    for r in rows[:10]:
        emit(dict(part="decode64", what="anchor D64 32/4 bf16 wide grid", shape=shape, **r))
    emit(dict(part="decode64", what="wide grid size", configs=len(rows),
              worst=rows[-1] if rows else None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("write", "decode64", "all"))
    ap.add_argument("--out", default="/tmp/kvgen-gaps")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no decode measurement after this many seconds")
    args = ap.parse_args(argv)
    import triton

    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_bw = bench_run.copy_bandwidth()
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  copy_bandwidth=copy_bw, command="python -m benchmarks.experiments.gaps " + " ".join(argv or sys.argv[1:]),
                  rows=[])
    print(f"# {report['gpu']}, torch {report['torch']}, triton {report['triton']}, copy bandwidth {copy_bw / 1e12:.3f} TB/s")

    def emit(row):
        report["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        (out_dir / "gaps.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    if args.what in ("write", "all"):
        write_part(copy_bw, emit)
    if args.what in ("decode64", "all"):
        decode64_part(copy_bw, emit, t0 + args.budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
