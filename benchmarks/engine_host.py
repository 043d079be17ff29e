"""Host time of an engine decode step, with the model replaced by a stand-in: what the GPU would wait for.

    python -m benchmarks.engine_host [--batches 1,8,32,128] [--context 2048] [--steps 50] [--device cpu]
                                     [--kv fp16] [--vocab 4096] [--graphs] [--profile 32] [--async-scheduling]

Builds a real engine (planner, compiled kernels, runtime KVCache, block
manager, scheduler, sampler) for a tiny random Llama config, but swaps the
runner's model for :class:`StubModel`: hidden states and logits of the right
shapes, no kernels. So a step's time is host work only: scheduling, the
block manager's reservation, packing and uploading the step metadata, the
runner's input tensors (and with ``--graphs`` the static-buffer copies of
the CUDA-graph path, run uncaptured), sampling, stop checks, outputs.

B sequences of ``--context`` prompt tokens are prefilled (stand-in, so
instant), then ``--steps`` decode steps are timed; printed per B: ms per
step in total and per phase (phases nest: ``plan_step`` is inside
``schedule``, ``reserve_step`` and ``build_step`` inside ``plan_step``;
``engine`` is the step minus schedule, run, sample and outputs).

Times are this thread's CPU time by default (``--clock cpu``: steady when
other processes share the cores); ``--clock wall`` gives wall time.
``--device cuda --clock wall`` measures the same on a GPU (pinned staging, H2D copies
and the sampler's small kernels included; the one sync is the sampled ids).
``--profile B`` prints cProfile's top functions over the steps at batch B.
Sampling is greedy over ``--vocab`` logits: on the CPU the argmax is
real work, so keep the vocabulary small to see the host part.
``--async-scheduling`` runs the engine's async path (decode step n+1 planned
before step n's ids are read; ``schedule`` then includes
``schedule_continuation``). On the CPU nothing overlaps, so the ms are the
same host work in another order; on a GPU with ``--clock wall`` the step time
shows the overlap.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import random
import sys
import time
from collections import defaultdict

# The engine's CPU path runs generated Triton modules; they must import interpreted (never launched here).
if "cuda" not in " ".join(sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvgen.engine.config import DEFAULT_ENGINE_BACKEND  # noqa: E402 (the backend the engines here are asked for, recorded)

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)


class StubModel:
    """Stands in for CausalLM: zero hidden states ``[T, hidden]`` and fixed logits ``[N, vocab]``, no kernels."""

    def __init__(self, hidden: int, vocab: int, max_rows: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(max_rows, vocab, generator=g).to(device)
        self.hidden = hidden
        self.device = device

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden, device=self.device)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return self.table[:hidden.shape[0]]


class PhaseTimer:
    """Wraps callables so each call adds its wall time to ``totals[name]``."""

    def __init__(self, sync, clock=time.perf_counter) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.sync = sync
        self.clock = clock

    def wrap(self, name: str, fn):
        totals, clock = self.totals, self.clock

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += clock() - t
        return timed

    def reset(self) -> None:
        self.totals.clear()


def build(B: int, context: int, steps: int, args, timer: PhaseTimer):
    from kvgen.engine import SamplingParams
    from kvgen.engine.loader import build_engine

    max_len = context + steps + 64
    cfg = dict(TINY, vocab_size=args.vocab)
    eng = build_engine(config=cfg, kv=args.kv, dtype=args.dtype, device=args.device, max_model_len=max_len,
                       max_num_seqs=B, max_tokens=B * max_len + 1024, max_num_batched_tokens=max(8192, B),
                       page_size=args.page_size, enforce_eager=True, autotune=False, verbose=False,
                       async_scheduling=args.async_scheduling)
    dev = torch.device(args.device)
    stub = StubModel(TINY["hidden_size"], args.vocab, max(B, 1), dev)
    runner = eng.runner
    runner.model = stub
    if args.graphs:
        from kvgen.engine.graphs import DecodeGraphs
        runner.graphs = DecodeGraphs(stub, eng.cache, B, max_len, verbose=False, capture=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10 ** 6, ignore_eos=True)
    for _ in range(B):
        eng.add_request(None, [rng.randrange(1, args.vocab) for _ in range(context)], params)
    while eng.scheduler.waiting or any(s.num_computed < len(s.tokens) - 1 for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):  # warm: every sequence decoding, buffers grown
        eng.step()
    instrument(eng, timer)
    return eng


def instrument(eng, timer: PhaseTimer) -> None:
    import kvgen.engine.engine as engine_mod

    cache = eng.cache
    # The compiled package ships its own copy of the runtime: patch the module the cache comes from.
    cache_mod = sys.modules[type(cache).__module__]
    eng.scheduler.schedule = timer.wrap("schedule", eng.scheduler.schedule)
    eng.scheduler.schedule_continuation = timer.wrap("schedule", eng.scheduler.schedule_continuation)
    cache.plan_step = timer.wrap("plan_step", cache.plan_step)
    cache.block_manager.reserve_step = timer.wrap("reserve_step", cache.block_manager.reserve_step)
    for mod, name, phase in ((cache_mod, "build_step", "build_step"), (engine_mod, "sample_async", "sample")):
        fn = getattr(mod, name, None)
        if fn is not None:  # module-level: unwrap an earlier batch's timer first
            setattr(mod, name, timer.wrap(phase, getattr(fn, "__wrapped__", fn)))
    eng.runner.run = timer.wrap("run", eng.runner.run)
    eng._collect = timer.wrap("outputs", eng._collect)


def measure(B: int, args) -> dict:
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    timer = PhaseTimer(sync, clock)
    eng = build(B, args.context, args.steps, args, timer)
    timer.reset()
    prof = cProfile.Profile() if args.profile == B else None
    sync()
    async0 = eng.num_async_steps
    t0 = clock()
    if prof is not None:
        prof.enable()
    for _ in range(args.steps):
        eng.step()
    if prof is not None:
        prof.disable()
    sync()
    total = clock() - t0
    async_steps = eng.num_async_steps - async0
    eng.async_scheduling = False  # drains the step in flight (async: its tokens are read one call later)
    assert all(s.num_computed == len(s.tokens) - 1 for s in eng.scheduler.running)
    ms = {k: 1e3 * v / args.steps for k, v in timer.totals.items()}
    ms["step"] = 1e3 * total / args.steps
    ms["async_steps"] = async_steps
    ms["engine"] = ms["step"] - sum(ms.get(k, 0.0) for k in ("schedule", "run", "sample", "outputs"))
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    return ms


PHASES = ("step", "schedule", "plan_step", "reserve_step", "build_step", "run", "sample", "outputs", "engine")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="fp16")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--graphs", action="store_true", help="runner goes through DecodeGraphs' static buffers")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine's async scheduling (decode step n+1 planned before step n's ids are read)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the timed steps at this batch size")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (steady on a shared machine; misses waits on the GPU); "
                         "wall: perf_counter (use on a GPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no intra-op pool contention)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    print(f"host ms per decode step ({args.clock} time, context {args.context}, {args.device}, kv {args.kv}, "
          f"stub model{', async scheduling' if args.async_scheduling else ''})")
    print("B".rjust(5) + "".join(p.rjust(13) for p in PHASES))
    for B in (int(b) for b in args.batches.split(",")):
        ms = measure(B, args)
        rows[B] = ms
        print(str(B).rjust(5) + "".join(f"{ms.get(p, 0.0):13.3f}" for p in PHASES)
              + (f"   async steps {ms['async_steps']}/{args.steps}" if args.async_scheduling else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernel_backend": DEFAULT_ENGINE_BACKEND, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
