"""Experiment: time decode over a wider config grid than ``decode.candidates()`` offers.

Question it answers: is quantized decode bound by a per-tile latency chain
(block-table load -> page loads -> dots) rather than by bytes or issue rate?
If so, tiles holding more tokens (or deeper pipelines) should speed up the
schemes whose tokens are small, while bf16 stays where it is.

    python -m benchmarks.experiments.decode_sweep [--schemes bf16,int8,...] [--out DIR]

Shape: B=32, L=4096, 64/8 heads, D=128, page 16, bf16. Grid: tokens per tile
{64, 128, 256, 512} x warps {4, 8} x stages {2, 3} x splits {1, 2},
skipping configs whose pipelined K+V tiles would not fit in shared memory
(counted with the scheme's own bytes per token). Prints the 6 best configs
per scheme and writes every timing to DIR/decode_sweep.json.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks import run as bench_run

SMEM_BYTES = 220 * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="bf16,int8,fp8,int4,int2")
    ap.add_argument("--shape", default="32,4096,64,8,128")
    ap.add_argument("--out", default="/tmp/kvgen-sweep")
    args = ap.parse_args(argv)
    B, L, Hq, Hkv, D = (int(x) for x in args.shape.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_run.PAGE = 16
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, L, Hq, Hkv, D],
              "results": {}}
    import triton
    report["triton"] = triton.__version__
    for name in args.schemes.split(","):
        mod, scheme = bench_run.kernel_module("decode", name, Hkv, Hq // Hkv, D)
        case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D)
        ref = case.reference()
        out = torch.empty_like(case.q)
        per_token = scheme.bytes_per_token_per_kv_head(D, 16) * 1.0
        rows = []
        t0 = time.time()
        for tokens in (64, 128, 256, 512):
            for warps in (4, 8):
                for stages in (2, 3):
                    if tokens * per_token * (stages - 1) > SMEM_BYTES:
                        continue
                    for splits in (1, 2):
                        cfg = {"num_splits": splits, "pages_per_tile": tokens // 16, "num_warps": warps,
                               "num_stages": stages}

                        def run():
                            mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens,
                                       case.num_compressed, 1 / math.sqrt(D), cfg)
                        try:
                            ms, err = bench_run.checked_time(run, out, ref, rep_ms=50)
                        except Exception as exc:  # out of registers / shared memory: skip
                            print(f"  {name} {cfg} failed: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
                            continue
                        rows.append({"cfg": cfg, "ms": ms, "err": err,
                                     "bw_fraction_of_4.28TBs": case.bytes / (ms * 1e-3) / 4.28e12})
        rows.sort(key=lambda r: r["ms"])
        report["results"][name] = {"bytes": case.bytes, "rows": rows, "sweep_s": time.time() - t0}
        (out_dir / "decode_sweep.json").write_text(json.dumps(report, indent=1))
        print(f"{name}: {len(rows)} configs in {time.time() - t0:.0f} s, bytes {case.bytes}", flush=True)
        for r in rows[:6]:
            print(f"   {r['ms']:.4f} ms  bw {r['bw_fraction_of_4.28TBs']:.3f}  err {r['err']:.4f}  {r['cfg']}", flush=True)
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
