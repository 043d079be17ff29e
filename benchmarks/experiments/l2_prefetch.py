"""Experiment: would an L2 prefetch of the o projection's weight, issued while attention runs, speed up the o GEMM?

    python -m benchmarks.experiments.l2_prefetch [--out DIR]

Quantized decode attention is issue-bound and leaves DRAM bandwidth idle, so the next GEMM's weight (Llama-3-8B's
o projection: 4096 x 4096 bf16, 32 MiB, well inside an H200's 60 MiB L2) could be pulled into L2 meanwhile. This
times the 32-row GEMM (cuBLAS and kvgen's small GEMM) after an L2 flush (a read of 512 MiB), after a first run of
itself (the weight then in L2: the most a prefetch could give), and after each prefetch kind -- bulk
(``cp.async.bulk.prefetch.L2``, 4/16/64 KiB chunks, with and without an evict-last policy), per 128-byte line
(``prefetch.global.L2::evict_last``) and plain evict-last loads -- followed by a 100 us sleep or by a 92 MiB
stream read (int4 KV at B=32, 2K tokens, one layer) with the normal or the evict-first policy. Everything is queued
behind a sleep on the GPU, so the times exclude host launch gaps. Prints one line per case (us medians of 20) and
writes DIR/l2.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from kvgen.engine import small_gemm


@triton.jit
def bulk_prefetch(ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, LAST: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_chunks
    addr = ptr + tl.where(m, i, 0).to(tl.int64) * CHUNK
    size = tl.full([BLOCK], CHUNK, tl.int32)
    if LAST:
        d = tl.inline_asm_elementwise(
            "{ .reg .b64 pol; .reg .pred p; setp.ne.u32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
            " @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, m.to(tl.int32), size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        d = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, m.to(tl.int32), size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(ptr.to(tl.pointer_type(tl.int32)) + i, d, mask=i < 0)  # never: keeps the asm

@triton.jit
def line_prefetch(ptr, n_lines, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_lines
    addr = ptr + tl.where(m, i, 0).to(tl.int64) * 128
    d = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [addr, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(ptr.to(tl.pointer_type(tl.int32)) + i, d, mask=i < 0)

@triton.jit
def stream_read(src, out, n, BLOCK: tl.constexpr, FIRST: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if FIRST:
            acc += tl.load(src + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        else:
            acc += tl.load(src + offs, mask=offs < n, other=0)
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def load_prefetch(src, out, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/l2_prefetch")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print("L2 bytes", getattr(props, "L2_cache_size", None), "SMs", props.multi_processor_count)
    W = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(32, 4096, device=dev, dtype=torch.bfloat16)
    flushbuf = torch.ones(512 * 2**20 // 4, dtype=torch.int32, device=dev)
    kv = torch.randint(0, 100, (92 * 2**20 // 4,), device=dev, dtype=torch.int32)
    sink = torch.empty(264 * 4096, dtype=torch.int32, device=dev)
    cfg = small_gemm.Config(64, 128, 1, 4, 6)
    nb = W.numel() * 2
    Wi = W.view(torch.int32).view(-1)

    def flush():
        stream_read[(132 * 4,)](flushbuf, sink, flushbuf.numel(), BLOCK=1024, FIRST=False, num_warps=4)

    def do_prefetch(kind):
        if kind.startswith("bulk"):
            chunk = int(kind.split("_")[1]) * 1024
            n = nb // chunk
            bulk_prefetch[(triton.cdiv(n, 128),)](W, n, CHUNK=chunk, BLOCK=128, LAST=kind.endswith("last"), num_warps=4)
        elif kind == "line":
            n = nb // 128
            line_prefetch[(triton.cdiv(n, 1024),)](W, n, BLOCK=1024, num_warps=8)
        elif kind == "load":
            load_prefetch[(132 * 4,)](Wi, sink, Wi.numel(), BLOCK=1024, num_warps=4)
        elif kind == "gemm":
            gemms["cublas"]()

    def stream(first):
        stream_read[(132 * 2,)](kv, sink, kv.numel(), BLOCK=512, FIRST=first, num_warps=4)

    gemms = {"cublas": lambda: torch.mm(x, W.t()), "small": lambda: small_gemm.small_gemm(x, W, None, cfg)}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    res = {}
    def trial(pref, strm, gemm, warm=False):
        flush()
        torch.cuda._sleep(400_000)  # the host queues everything below before the GPU reaches it
        if warm:
            gemms[gemm]()
        ev[0].record()
        if pref:
            do_prefetch(pref)
        ev[1].record()
        if strm == "sleep":
            torch.cuda._sleep(100_000)
        elif strm is not None:
            stream(strm)
        ev[2].record()
        gemms[gemm]()
        ev[3].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) * 1e3, ev[1].elapsed_time(ev[2]) * 1e3, ev[2].elapsed_time(ev[3]) * 1e3

    kinds = ("bulk_4_last", "bulk_16_last", "bulk_64_last", "bulk_64", "line", "load")
    for gemm in gemms:
        gemms[gemm]()
    for kind in kinds:
        do_prefetch(kind)
    stream(True); stream(False); flush(); torch.cuda.synchronize()
    cases = ([(None, None, False), (None, None, True), (None, "sleep", False), (None, False, False), (None, True, False)]
             + [(k, "sleep", False) for k in kinds] + [(k, s, False) for k in kinds for s in (False, True)])
    for gemm in gemms:
        for pref, strm, warm in cases:
            ts = [trial(pref, strm, gemm, warm) for _ in range(25)][5:]
            med = [statistics.median(t[i] for t in ts) for i in range(3)]
            sname = {None: "none", "sleep": "sleep", False: "normal", True: "evict_first"}[strm]
            key = f"{gemm} warm={warm} prefetch={pref} then={sname}"
            res[key] = med
            print(f"{key:60s} prefetch {med[0]:7.1f}  then {med[1]:7.1f}  gemm {med[2]:6.1f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    json.dump(res, open(os.path.join(args.out, "l2.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
