"""Does a page's split into separate pools cost DRAM throughput? A read-only probe of the decode's access pattern.

    python -m benchmarks.experiments.stream_layout [--out FILE] [--batch 32] [--length 4096] [--heads 8]

Nsight Compute read the CUDA int4 decode at 32 x 4096 (64/8, D=128) at 2.45-2.50 TB/s of DRAM whether 8 or 16 warps
an SM ran it (2026-12-05-nvidia-h100-5): more warps only waited longer. int8 read 2.81 TB/s, bf16 2.99. A KIVI tile
reads six tensors of a page (codes of K and V, 1 KB each at D=128; key scales and zeros, 256 B each; value scales
and zeros, 128 B each), each from its own pool; int8 reads four (2 KB, 2 KB, 64 B, 64 B), bf16 two of 4 KB.

Here one Triton kernel reads the same bytes per (page, KV head) in the decode's order -- a program per (sequence,
KV head), its pages in a random order through a block table, each stream's bytes loaded and folded into a checksum
-- from the pools as kvgen lays them out (``separate``: one tensor per stream) and from one pool holding each
(page, head)'s streams back to back (``together``), and reports each one's TB/s. No attention math: what the
memory system gives each layout. The scheme geometries are the built-in schemes' at D=128, page 16.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

GEOMETRIES = {  # bytes of each stream per (page, KV head) at D=128, page 16 (plugins/kivi.py, plugins/int8.py)
    "bf16": (4096, 4096),
    "int8": (2048, 2048, 64, 64),
    "int4": (1024, 1024, 256, 256, 128, 128),
    "int2": (512, 512, 256, 256, 128, 128),
}
MAX_STREAMS = 6


@triton.jit
def _read_pages(bt, out, p0, p1, p2, p3, p4, p5, s0, s1, s2, s3, s4, s5, n_pages, H,
                W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                W5: tl.constexpr, STAGES: tl.constexpr):
    """Program (b, h): fold the int32 words of every stream of its pages (block table row b) into one checksum.
    Stream i has Wi words per (page, head) at pi + (page * H + h) * si; Wi = 0 leaves it out."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    acc = tl.zeros((1,), dtype=tl.int32)
    for i in tl.range(0, n_pages, num_stages=STAGES):
        ph = tl.load(bt + b * n_pages + i).to(tl.int64) * H + h
        if W0 > 0:
            acc += tl.sum(tl.load(p0 + ph * s0 + tl.arange(0, W0)), axis=0)
        if W1 > 0:
            acc += tl.sum(tl.load(p1 + ph * s1 + tl.arange(0, W1)), axis=0)
        if W2 > 0:
            acc += tl.sum(tl.load(p2 + ph * s2 + tl.arange(0, W2)), axis=0)
        if W3 > 0:
            acc += tl.sum(tl.load(p3 + ph * s3 + tl.arange(0, W3)), axis=0)
        if W4 > 0:
            acc += tl.sum(tl.load(p4 + ph * s4 + tl.arange(0, W4)), axis=0)
        if W5 > 0:
            acc += tl.sum(tl.load(p5 + ph * s5 + tl.arange(0, W5)), axis=0)
    tl.store(out + b * H + h + tl.arange(0, 1), acc)


def pools(geometry: tuple[int, ...], pages: int, H: int, layout: str, device):
    """(the streams' int32 views, each offset to its stream, and their row strides in words)."""
    words = [n // 4 for n in geometry]
    if layout == "separate":
        return ([torch.randint(-2**30, 2**30, (pages * H * w,), dtype=torch.int32, device=device) for w in words],
                words)
    stride = sum(words)
    base = torch.randint(-2**30, 2**30, (pages * H * stride,), dtype=torch.int32, device=device)
    return [base[sum(words[:i]):] for i in range(len(words))], [stride] * len(words)


def checksum_reference(streams, strides, words, bt, H):
    """The kernel's checksum in torch (int64 sums wrapped to int32)."""
    out = torch.zeros(bt.shape[0], H, dtype=torch.int64, device=bt.device)
    for t, s, w in zip(streams, strides, words):
        for h in range(H):
            idx = ((bt.long() * H + h) * s)[..., None] + torch.arange(w, device=bt.device)
            out[:, h] += t[idx].long().sum(dim=(1, 2))
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)


def case(name: str, layout: str, B: int, L: int, H: int, device, seed: int = 0):
    """(launch, check, bytes read) of one scheme geometry and layout: B sequences of L tokens, H KV heads, pages
    of 16 tokens in a random order."""
    torch.manual_seed(seed)
    words = [n // 4 for n in GEOMETRIES[name]]
    n_pages = L // 16
    pages = B * n_pages + 64
    streams, strides = pools(GEOMETRIES[name], pages, H, layout, device)
    bt = torch.randperm(pages, device=device)[: B * n_pages].to(torch.int32).view(B, n_pages).contiguous()
    out = torch.empty(B, H, dtype=torch.int32, device=device)
    pad = MAX_STREAMS - len(words)
    args = (*streams, *[streams[0]] * pad, *strides, *[0] * pad, n_pages, H, *words, *[0] * pad)

    def launch(stages=3, warps=4):
        _read_pages[(B, H)](bt, out, *args, STAGES=stages, num_warps=warps)

    def check():
        return bool(torch.equal(out, checksum_reference(streams, strides, words, bt, H)))

    return launch, check, B * n_pages * H * sum(GEOMETRIES[name])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--schemes", default="bf16,int8,int4,int2")
    a = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph

    records = []
    for name in a.schemes.split(","):
        for layout in ("separate", "together"):
            launch, check, nbytes = case(name, layout, a.batch, a.length, a.heads, "cuda")
            best = None
            for stages in (2, 3, 4):
                for warps in (2, 4, 8):
                    launch(stages, warps)
                    torch.cuda.synchronize()
                    assert check(), f"{name} {layout}: checksum differs"
                    ms = min(do_bench_cudagraph(lambda: launch(stages, warps), rep=50) for _ in range(3))
                    if best is None or ms < best[0]:
                        best = (ms, stages, warps)
            ms, stages, warps = best
            rec = {"scheme": name, "layout": layout, "B": a.batch, "L": a.length, "H": a.heads, "ms": ms,
                   "TBps": nbytes / ms / 1e9, "stages": stages, "warps": warps}
            records.append(rec)
            print(f"{name:5s} {layout:9s} {ms * 1e3:8.1f} us  {rec['TBps']:.2f} TB/s  (stages {stages}, warps {warps})",
                  flush=True)
    if a.out:
        from benchmarks.experiments.records import write_records

        write_records(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
