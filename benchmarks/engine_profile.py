"""Where an engine decode step's time goes (GPU): kernel time per step by kernel, against the step's wall time.

    python -m benchmarks.engine_profile [--kv bf16,int4] [--shapes 1x16384,32x2048] [--out profile.json]
                                        [--async-scheduling]

Builds the random-weight Llama-3-8B engine of ``benchmarks.engine``, fills B
sequences to L tokens, then measures for each shape and scheme:

- ``graph_ms``: wall ms per decode step through CUDA graphs (as ``engine.py``);
- ``graph_async_ms`` (with ``--async-scheduling``): the same with the
  engine's async scheduling on (step n+1 planned while step n runs), on the
  same engine right after ``graph_ms``;
- ``eager_ms``: the same without graphs;
- ``graph_kernels`` / ``graph_kernel_ms`` / ``graph_groups``: the same
  profile over graph steps (the kernels a replay runs, with the configs
  fixed at capture), so ``graph_ms - graph_kernel_ms`` is the step outside
  kernels: launch gaps, the static buffers' copies (memcpy/memset are not
  counted as kernels) and host time the device waits for;
- ``kernels``: torch.profiler over ``--steps`` eager steps, kernel name ->
  device µs per step, largest first, and ``kernel_ms`` their sum; with
  ``groups`` summing them by kind (gemm, attention, cache write, norm, rope,
  elementwise, sampling, other).

``graph_ms - kernel_ms`` is what the step spends outside kernels (launch gaps,
host work the GPU waits for); ``kernel_ms - roofline_ms`` is kernel
inefficiency. Both are what issue 14's 1.2x-roofline goal needs split.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

import torch

from benchmarks import engine as bench_engine
from benchmarks.engine import filled_engine, log, parse_shape, release, timed_steps, weight_bytes
from benchmarks.run import copy_bandwidth
from kvgen.atomic import write_atomic

GROUPS = [  # (group, substrings of a kernel name), first match wins
    ("attention", ("decode", "prefill", "attn", "flash", "split_reduce")),
    ("cache_write", ("append", "write", "quant", "convert")),
    ("gemm", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "matmul", "splitk")),
    ("norm", ("rms", "norm")),
    ("rope", ("rope", "rotary")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "cumsum", "scatter", "gather")),
    ("elementwise", ("elementwise", "vectorized", "mul", "add", "silu", "copy", "cat", "fill")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def profiled_kernels(eng, steps: int) -> dict[str, float]:
    """Device µs per step by kernel name over ``steps`` engine steps (torch.profiler; graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_steps(eng, steps)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        if t and evt.key and not evt.key.startswith(("ProfilerStep", "cudaLaunch", "cudaGraphLaunch", "Memcpy",
                                                      "Memset")) \
                and evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.key] += t / steps
    return dict(per_kernel)


def grouped(per_kernel: dict[str, float]) -> dict[str, float]:
    """ms per step by kernel group, largest first."""
    groups: dict[str, float] = collections.defaultdict(float)
    for name, us in per_kernel.items():
        groups[group_of(name)] += us
    return {k: round(v / 1e3, 4) for k, v in sorted(groups.items(), key=lambda kv_: -kv_[1])}


def top_kernels(per_kernel: dict[str, float], n: int = 25) -> list[dict]:
    return [dict(name=k[:160], us=round(us, 2), group=group_of(k))
            for k, us in sorted(per_kernel.items(), key=lambda kv_: -kv_[1])[:n]]


def profile_case(kv: str, B: int, L: int, steps: int, bw: float, async_scheduling: bool = False) -> dict:
    eng = filled_engine(kv, B, L, L + 4 * steps + 64)
    eng.step()
    graph_ms = timed_steps(eng, steps)
    graph_async_ms = None
    if async_scheduling:
        eng.async_scheduling = True
        eng.step()  # the first step of a run is synchronous; it leaves itself in flight
        a0 = eng.num_async_steps
        graph_async_ms = timed_steps(eng, steps)
        if eng.num_async_steps - a0 != steps:
            log(f"async scheduling overlapped only {eng.num_async_steps - a0} of {steps} steps")
        eng.async_scheduling = False  # drains the step in flight
    graph_kernels = profiled_kernels(eng, steps)  # the kernels the graphs replay (their own configs)
    graphs, eng.runner.graphs = eng.runner.graphs, None  # eager: the runtime's tuned configs
    eng.step()
    eager_ms = timed_steps(eng, steps)
    per_kernel = profiled_kernels(eng, steps)
    eng.runner.graphs = graphs
    kv_bytes = B * (L + steps) * eng.plan.kv_bytes_per_token
    w = weight_bytes(eng)
    rec = dict(kind="profile", kv=kv, B=B, context=L, steps=steps, graph_ms=graph_ms, eager_ms=eager_ms,
               **({} if graph_async_ms is None else dict(graph_async_ms=graph_async_ms)),
               kernel_ms=sum(per_kernel.values()) / 1e3, roofline_ms=(w + kv_bytes) / bw * 1e3,
               weight_roofline_ms=w / bw * 1e3, kv_roofline_ms=kv_bytes / bw * 1e3,
               groups=grouped(per_kernel), kernels=top_kernels(per_kernel),
               graph_kernel_ms=sum(graph_kernels.values()) / 1e3, graph_groups=grouped(graph_kernels),
               graph_kernels=top_kernels(graph_kernels))
    holder = [eng]
    del eng
    release(holder)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="bf16,int4")
    ap.add_argument("--shapes", default="1x16384,32x2048")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/engine_profile.json")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also time graph steps with the engine's async scheduling (graph_async_ms)")
    from kvgen.engine.config import DEFAULT_ENGINE_BACKEND, ENGINE_BACKENDS

    ap.add_argument("--kernel-backend", default=DEFAULT_ENGINE_BACKEND, choices=ENGINE_BACKENDS,
                    help="the decode kernel's language, as benchmarks.engine --kernel-backend")
    args = ap.parse_args(argv)
    bench_engine.KERNEL_BACKEND = args.kernel_backend
    import triton

    bw = copy_bandwidth()
    records: list[dict] = []
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bandwidth=bw, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               command="python -m benchmarks.engine_profile " + " ".join(argv or sys.argv[1:]),
               kernel_backend=args.kernel_backend, records=records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        B, L = parse_shape(shape)
        for kv in args.kv.split(","):
            try:
                rec = profile_case(kv, B, L, args.steps, bw, args.async_scheduling)
            except Exception as e:  # one failing case must not lose the rest
                log(f"{kv} {shape} failed: {type(e).__name__}: {e}")
                continue
            log(json.dumps({k: v for k, v in rec.items() if k not in ("kernels", "graph_kernels")}))
            for k in rec["kernels"][:12]:
                log(f"  {k['us']:9.1f} us  {k['group']:12s} {k['name'][:100]}")
            records.append(rec)
            write_atomic(out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
