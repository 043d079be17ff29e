"""Experiment: the KIVI page_quantize kernel per launch, as a decode graph runs it (one launch a layer, 32 layers).

Each variant of the generated kernel's source is timed from one CUDA graph holding 32 launches over 32 layers'
pools (cold in L2), with M real (src, dst) pairs out of 32 programs a KV head (the rest src -1: the graphs' padding):

- ``base``: the tree's kernel;
- ``divrn``: the tree's kernel with the codes rounded as before 2026-12-03's change, a correctly rounded division
  per element (``(x - z) / s + 0.5``) instead of the group's reciprocal and one fma;
- ``loadstore``: the floor, loading both residual pages and storing bytes with no quantization.

Before timing, ``base`` and ``divrn`` quantize the same pages into copies of one layer's pools, and the script
prints how many stored elements differ (both round half up; they may differ where the reciprocal's rounding
moves a code across a half).

    python -m benchmarks.experiments.page_quantize_bench [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

D, H, PAGE, LAYERS, POOL_PAGES = 128, 8, 16, 32, 600


def _module(src: str, name: str, folder: str):
    path = Path(folder) / f"pq_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"pq_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variants(src: str) -> dict[str, str]:
    """The three sources (see the module docstring) from the tree's rendered kernel."""
    old = src
    for t, sc, x in (("k", "k_sf", "k_x - k_zf"), ("v", "v_sf", "v_g - v_zf")):
        pat = re.compile(rf"    {t}_q_r = .*\n    {t}_q_n, {t}_q_rb = .*\n    {t}_q = tl.fma\({t}_q_n, {t}_q_rb, 0.5\)\n")
        if not pat.search(old):
            raise SystemExit(f"the kernel's {t} rounding is not the reciprocal + fma this experiment rewrites")
        old = pat.sub(f"    {t}_q_n, {t}_q_d = tl.broadcast({x}, tl.where({sc} > 0, {sc}, 1.0))\n"
                      f"    {t}_q = tl.math.div_rn({t}_q_n, {t}_q_d) + 0.5\n", old)
    head, _, tail = src.partition("    base = dst * H + h\n")
    store = ("    base = dst * H + h\n    offs_b = tl.arange(0, 64)\n"
             "    tl.store(k_ptr + base * 1024 + offs_t[:, None] * 64 + offs_b[None, :], "
             "tl.sum(tl.reshape(k, (16, 64, 2)), axis=2).to(tl.uint8))\n"
             "    tl.store(v_ptr + base * 1024 + offs_t[:, None] * 64 + offs_b[None, :], "
             "tl.sum(tl.reshape(v, (16, 64, 2)), axis=2).to(tl.uint8))\n")
    return {"base": src, "divrn": old, "loadstore": head + store + tail[tail.index("\n\n\ndef launch"):]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/page_quantize_bench.json")
    args = ap.parse_args(argv)
    from kvgen.codegen.render import render_kernel
    from kvgen.runtime.pools import allocate_pool
    from tests.kernels import harness as hz

    s = hz.get_scheme("int4")
    src = render_kernel(hz.kernel_spec("page_quantize", "int4", D, H, 8, PAGE, torch.bfloat16, dev="cuda"), s)
    folder = tempfile.mkdtemp()
    mods = {name: _module(text, name, folder) for name, text in variants(src).items()}
    layers = []
    for _ in range(LAYERS):
        pools = allocate_pool(hz.pool_descriptions(s, D, PAGE), POOL_PAGES, H, torch.bfloat16, "cuda", zero=True)
        pools.update(allocate_pool(hz.residual_descriptions(D, PAGE), POOL_PAGES, H, torch.bfloat16, "cuda",
                                   zero=True))
        pools["rk"].normal_()
        pools["rv"].normal_()
        layers.append(pools)

    def pairs(m: int, n: int = 32):
        gen = torch.Generator(device="cuda").manual_seed(m)
        src_p = torch.randperm(POOL_PAGES, device="cuda", generator=gen)[:n].to(torch.int32)
        dst_p = torch.randperm(POOL_PAGES, device="cuda", generator=gen)[:n].to(torch.int32)
        src_p[m:] = -1
        return src_p, dst_p

    # base against divrn on the same pages (copies of layer 0's pools)
    src_p, dst_p = pairs(32)
    outs = {}
    for name in ("base", "divrn"):
        pools = {n: t.clone() for n, t in layers[0].items()}
        mods[name].launch(pools, src_p, dst_p)
        outs[name] = {n: pools[n][dst_p.long()] for n in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")}
    differ = {n: int((outs["base"][n] != outs["divrn"][n]).sum()) for n in outs["base"]}
    sizes = {n: outs["base"][n].numel() for n in outs["base"]}
    print(f"divrn against base, 32 pages x {H} heads: differing elements {differ} of {sizes}", flush=True)

    times = {}
    for name, mod in mods.items():
        for m in (32, 2, 0):
            src_p, dst_p = pairs(m)
            kern = mod._page_quantize_kernel

            def body():
                for pools in layers:
                    kern[(32, H)](*[pools[x] for x in mod.POOL_TENSORS], src_p, dst_p)

            body()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graph.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(20):
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                samples.append(e0.elapsed_time(e1))
            us = sorted(samples)[len(samples) // 2] * 1e3 / LAYERS
            times[f"{name} M={m}"] = us
            print(f"int4 {name:9s} M={m:2d} of 32 pairs x {H} heads: {us:6.2f} us per launch", flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "command": "python -m benchmarks.experiments.page_quantize_bench " + " ".join(sys.argv[1:]),
                   "differ": differ, "sizes": sizes, "us_per_launch": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
