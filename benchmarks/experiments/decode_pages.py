"""Experiment: does the page size / page order bound quantized decode?

    python -m benchmarks.experiments.decode_pages

B=32, L=4096, 64/8 heads, D=128, bf16. For each scheme and page size, the
same pages read in a shuffled order (as the benchmark and a long-running
server) and in order (block table = arange: every sequence's pages contiguous
in memory). If a scheme runs much faster in order, or with larger pages, the
DRAM access pattern (small scattered chunks: a page of one KV head is
page * D bytes of int8 codes) is what bounds it, not the kernel's inner loop.
Three fixed configs per case (128-token tiles / 1 split, 64-token tiles /
2 splits, 256-token tiles / 8 warps); the best is printed.
"""

import math
import sys

import torch

from benchmarks import run as bench_run

B, L, HQ, HKV, D = 32, 4096, 64, 8, 128


def main() -> int:
    for name in sys.argv[1].split(",") if len(sys.argv) > 1 else ("bf16", "int8", "int4"):
        for page in (16, 64):
            bench_run.PAGE = page
            mod, scheme = bench_run.kernel_module("decode", name, HKV, HQ // HKV, D)
            case = bench_run.DecodeCase(scheme, B, L, HQ, HKV, D)
            ref = case.reference()
            out = torch.empty_like(case.q)
            shuffled = case.block_tables.clone()
            nc = int(case.num_compressed[0])
            ordered = shuffled.clone()
            ordered[:, :nc] = torch.arange(B * nc, device="cuda", dtype=torch.int32).view(B, nc)
            # the ordered table must point at the same data: permute the compressed pool pages to match
            perm = shuffled[:, :nc].flatten().long()
            for t in scheme.page_tensors(D, page):
                case.pools[t.name + "_ordered"] = case.pools[t.name][perm].contiguous()
            pools_ordered = {n: case.pools.get(n + "_ordered", case.pools[n]) for n in case.pools if not n.endswith("_ordered")}
            pools_shuffled = {n: case.pools[n] for n in case.pools if not n.endswith("_ordered")}
            cfgs = [{"pages_per_tile": max(1, 128 // page), "num_warps": 4, "num_stages": 3, "num_splits": 1},
                    {"pages_per_tile": max(1, 64 // page), "num_warps": 4, "num_stages": 2, "num_splits": 2},
                    {"pages_per_tile": max(1, 256 // page), "num_warps": 8, "num_stages": 2, "num_splits": 1}]
            for label, pools, bt in (("shuffled", pools_shuffled, shuffled), ("ordered", pools_ordered, ordered)):
                best = None
                for cfg in cfgs:
                    def run():
                        mod.launch(case.q, out, pools, bt, case.seq_lens, case.num_compressed, 1 / math.sqrt(D), cfg)
                    try:
                        ms, err = bench_run.checked_time(run, out, ref)
                    except Exception as exc:
                        print(f"  {name} page {page} {cfg} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, cfg, err)
                if best:
                    ms, cfg, err = best
                    print(f"{name:5} page {page:3} {label:8} {ms:.4f} ms  bw {case.bytes / (ms * 1e-3) / 4.28e12:.3f}"
                          f"  err {err:.4f}  {cfg}", flush=True)
            del case, pools_ordered, pools_shuffled
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
