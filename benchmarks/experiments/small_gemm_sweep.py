"""Experiment: kvgen's small GEMM (kvgen.engine.small_gemm) against cuBLAS for a decode step's 5 to 64 rows (GPU).

The projections of a Llama-3-8B layer (q/k/v, o, gate/up, down) and the LM head, bf16, at ``--rows`` rows;
each timed from a CUDA graph cycling over 8 weight copies (cold in L2, as in a model's step; the runtime's
graph timer), every config checked against a float64 reference first. At ``--wide-rows`` it sweeps a wider
grid of tiles, stages, warps and splits than the engine's chooser times (which tiles to keep); elsewhere the
chooser's own candidates. Reports µs per call and the fraction of the copy bandwidth (measured in the same
process) its weight bytes reach.

    python -m benchmarks.experiments.small_gemm_sweep [--out FILE.json] [--rows 8,16,32,64] [--wide-rows 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
COPIES = 8
WIDE_TILES = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (128, 256),
              (256, 64), (256, 128))
SMEM = 227 * 1024


def wide_candidates(n: int, k: int, rows: int, num_sms: int):
    """Every (tile, stages, warps, split) of the wide grid that fits the shared memory and is not already
    over-split (more than four programs an SM)."""
    from kvgen.engine import small_gemm

    bm = small_gemm.row_block(rows)
    for bn, bk in WIDE_TILES:
        if k % bk:
            continue
        for stages in (3, 4, 6):
            if small_gemm.shared_bytes(small_gemm.Config(bn, bk, 1, 4, stages), bm) > SMEM:
                continue
            for warps in ((4, 8) if bn >= 128 else (4,)):
                tiles, blocks, split = -(-n // bn), k // bk, 1
                while split <= blocks and tiles * split <= 4 * num_sms:
                    yield small_gemm.Config(bn, bk, split, warps, stages)
                    split *= 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/small_gemm_sweep.json")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--wide-rows", default="32", help="row counts to sweep the wide grid at ('' for none)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    from triton.runtime.errors import OutOfResources

    from benchmarks.run import copy_bandwidth
    from kvgen.atomic import write_atomic
    from kvgen.engine import small_gemm
    from kvgen.runtime.kernel_timer import cycling, graph_time_ms

    import triton

    bw = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide = {int(r) for r in args.wide_rows.split(",") if r}
    records = []
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bandwidth=bw, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               command=" ".join(sys.argv), records=records)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(COPIES)]
        nbytes = N * K * 2
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = (x.double() @ ws[0].double().T)
            cublas = graph_time_ms(cycling(ws, lambda w: torch.nn.functional.linear(x, w)))
            cands = list(wide_candidates(N, K, rows, num_sms)) if rows in wide else small_gemm.candidates(N, K, num_sms)
            rec = dict(shape=name, N=N, K=K, rows=rows, cublas_us=cublas * 1e3, cublas_bw=nbytes / (cublas * 1e-3) / bw,
                       configs=[])
            t0 = time.time()
            for c in cands:
                entry = dict(config=c.__dict__)
                try:
                    y = small_gemm.small_gemm(x, ws[0], None, c)
                    err = float((y.double() - ref).norm() / ref.norm())
                    entry["rel_l2"] = err
                    if err > 1e-2:
                        entry["error"] = "wrong result"
                    else:
                        ms = graph_time_ms(cycling(ws, lambda w, c=c: small_gemm.small_gemm(x, w, None, c)))
                        entry.update(us=ms * 1e3, bw=nbytes / (ms * 1e-3) / bw, vs_cublas=ms / cublas)
                except OutOfResources as e:
                    entry["error"] = f"out of resources: {e}"
                rec["configs"].append(entry)
            timed = [e for e in rec["configs"] if "us" in e]
            if timed:
                best = min(timed, key=lambda e: e["us"])
                rec["best"] = best
            rec["seconds"] = time.time() - t0
            records.append(rec)
            b = rec.get("best")
            print(f"{name} {N}x{K} rows {rows}: cuBLAS {cublas * 1e3:.1f} us ({rec['cublas_bw']:.2f} BW); best "
                  + (f"{b['us']:.1f} us ({b['bw']:.2f} BW, {b['vs_cublas']:.3f}x) {b['config']}" if b else "none")
                  + f"; {len(timed)}/{len(cands)} timed in {rec['seconds']:.0f} s", flush=True)
            write_atomic(args.out, json.dumps(doc, indent=1))
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
