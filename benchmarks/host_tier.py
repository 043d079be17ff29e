"""Host tier benchmark (issue 17): pinned bandwidth, swap in/out, decode with cold pages, background swap-out.

    python -m benchmarks.host_tier [--schemes bf16,int4] [--out FILE]     # the H200
    python -m benchmarks.host_tier --smoke                                # the CPU (interpreted kernels, tiny)

One process, a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads, 32 query
heads, head_dim 128) through the runtime's own ``load(..., host_tokens=)``,
no model weights: attention steps run on random q/k/v, which is all the host
tier's cost depends on. Records (JSON ``{gpu, torch, date, pinned_h2d,
pinned_d2h, records: [...]}``, the decode benchmark's form), each with ``op``,
``scheme``, ``host_fraction``, ``ms``, ``bytes`` and ``bw_fraction`` (bytes
per second over the pinned host<->device bandwidth measured in this run, in
the direction of the transfer):

- ``pinned_h2d`` / ``pinned_d2h``: one 1 GiB copy between pinned host memory
  and the device (best of 5).
- ``swap_out`` / ``swap_in``: one ``--swap-tokens`` (100K) token sequence,
  every layer (done-when: swap_in ``bw_fraction >= 0.8``).
- ``decode_host``: the mean of ``--repeat`` consecutive decode steps (plan_step
  + every layer's append_kv and decode; the compute stream waited for after
  each, as an engine reading its sampled tokens does) of ``--batch`` sequences of ``--context`` tokens with 0, 25, 50 and
  75% of each sequence's pages cold; ``gpu_ms`` is the all-device step,
  ``transfer_ms`` the cold bytes at the pinned bandwidth, ``bound_ms`` their
  max and ``ratio`` = ``ms / bound_ms`` (done-when: <= 1.1).
- ``decode_during_swap_out``: the all-device decode step of ``--bg-batch``
  (32) sequences of ``--context`` tokens while another sequence of half
  ``--swap-tokens`` swaps out in the background, ``--bg-rounds`` times;
  ``slowdown``: the median round's mean step during the copies over the
  steps alone just before and after it, - 1 (done-when: <= 0.03;
  :func:`background_swap`).

Each ``decode_host`` record also has ``predicted_ms``: the planner's step
cost (:func:`kvgen.planner.host_cost.host_step_cost`, the function plans
use) for the record's device-resident and cold bytes at the pinned h2d
bandwidth measured in this run and the target preset's memory bandwidth
(top-level ``memory_bandwidth``), and ``prediction_error`` = ms / predicted_ms - 1
(done-when: within 15%). The ``engine`` part (benchmarks/host_tier_engine.py)
adds ``engine_swap`` / ``engine_recompute``: generated tokens/s of the
Llama-3-8B-shaped engine (random weights) on requests needing 2x its KV
budget, preempting by swap vs by recompute. ``--parts tier,engine`` picks
parts; a compact table of every record is printed on stdout at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, smoke: bool) -> None:
        import torch

        self.torch = torch
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.memory_bandwidth = self.target().memory_bandwidth  # the planner's device read figure

    def target(self):
        """The planner's target: the cpu preset (3 GiB) for the smoke, the h200 preset otherwise."""
        from kvgen.targets import resolve_target

        if self.smoke:
            return dataclasses.replace(resolve_target("cpu"), memory_bytes=3 * 2**30)
        return resolve_target("h200")

    def sync_compute(self) -> None:
        """Wait for the compute stream only (the host tier's side stream keeps copying)."""
        if self.device.type == "cuda":
            self.torch.cuda.current_stream(self.device).synchronize()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, fn, repeat: int = 1) -> float:
        """Median ms of ``fn()`` over ``repeat`` runs, synchronized around each."""
        times = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def steps_ms(self, step, n: int) -> float:
        """Mean ms of ``n`` consecutive ``step()``s that wait for the compute stream after each, as an engine
        reading its sampled tokens does (copies on the host tier's side stream run on across steps); one
        device-wide sync before and after all of them."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
            self.sync_compute()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / n

    def pinned(self, nbytes: int) -> dict[str, float]:
        """Bytes per second host->device and device->host through pinned memory (best of 5)."""
        torch = self.torch
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out = {}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)
            ms = min(self.timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(5))
            out[name] = nbytes / (ms * 1e-3)
        return out

    def cache(self, kv: str, *, max_tokens: int, host_tokens: int, staging_tokens: int, max_seqs: int):
        from kvgen.codegen.loader import load_kernel
        from kvgen.codegen.package import kernel_specs, plan_scheme
        from kvgen.models import ModelSpec, resolve_model
        from kvgen.planner.planner import make_plan
        from kvgen.planner.workload import Workload
        from kvgen.registry import default_registry
        from kvgen.runtime import load

        reg = default_registry()
        if self.smoke:
            spec = ModelSpec(name="tiny", num_layers=2, hidden_size=16, num_q_heads=2, num_kv_heads=1, head_dim=8,
                             intermediate_size=32, vocab_size=64, max_positions=4096, rope_theta=10000.0,
                             sliding_window=None, tied_embeddings=True, num_params=10_000,
                             architecture="LlamaForCausalLM")
            target = self.target()
            work = Workload(context=1024, concurrency=2, compute_dtype="float32", page_size=8)
        else:
            # Llama-3-8B's shape with room for the whole pool as one context (its preset stops at 8192
            # positions; Llama-3.1-8B, the same shape, has 131072): the planner refuses longer contexts.
            spec = dataclasses.replace(resolve_model("llama-3-8b"), max_positions=max(8192, max_tokens))
            target = self.target()
            work = Workload(context=max_tokens, concurrency=1, compute_dtype="bfloat16")
        plan = make_plan(spec, target, work, reg.schemes, kv=kv)
        scheme = plan_scheme(plan, reg)
        kernels = {op: load_kernel(s, scheme, reg) for op, s in kernel_specs(plan, reg, scheme).items()}
        # max_seqs sizes a residual scheme's tail pool (one window per sequence): the plan's own
        # concurrency of 1 left int4 four residual pages, too few for the decode batch (H200 run).
        return load(plan.to_json(), kernels, device=self.device, max_tokens=max_tokens, autotune=False,
                    host_tokens=host_tokens, staging_tokens=staging_tokens, max_seqs=max_seqs)

    def fill(self, cache, sid, tokens: int) -> None:
        """A sequence of ``tokens`` tokens whose pages hold whatever they hold (bandwidth needs no values)."""
        cache.add(sid)
        cache.plan_step([sid], [tokens])
        cache.step = None  # never run: only the pages were wanted

    def decode_step(self, cache, ids, qkv) -> None:
        q, k, v = qkv
        cache.plan_step(ids, 1)
        for layer in range(cache.num_layers):
            cache.decode(layer, q, ids, k, v)

    def qkv(self, cache, batch: int):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(0)
        mk = lambda h: torch.randn(batch, h, cache.head_dim, generator=g, device=self.device).to(cache.dtype)  # noqa: E731
        return mk(cache.num_q_heads), mk(cache.num_kv_heads), mk(cache.num_kv_heads)


def background_swap(b: Bench, cache, kv: str, ids: list, L: int, tokens: int, rounds: int, repeat: int) -> dict:
    """The ``decode_during_swap_out`` record: decode steps of ``ids`` while a ``tokens``-token sequence swaps out.

    ``repeat`` steps alone (a baseline), then ``rounds`` times: the swap-out,
    the steps until its copies finished, ``repeat`` steps alone again. Each
    round's slowdown compares its steps during the copies (mean) with the
    baselines just before and after it (median), so a drift of the GPU's
    speed over the run (seen on the H200: +7% between rounds with no swap)
    is not counted; ``slowdown`` is the median round's. The ``swap_out`` call
    itself (page accounting, queueing the copies) is ``issue_ms``, host time
    between two steps, counted in by ``slowdown_with_issue``.
    """
    qkv = b.qkv(cache, len(ids))
    b.decode_step(cache, ids, qkv)
    b.sync()

    def step_ms() -> float:
        t = time.perf_counter()
        b.decode_step(cache, ids, qkv)
        b.sync_compute()  # not the side stream: a device-wide sync would wait for the swap itself
        return (time.perf_counter() - t) * 1e3

    def alone() -> list[float]:
        b.sync()
        return [step_ms() for _ in range(repeat)]

    bases, during, issue = [alone()], [], []
    for _ in range(rounds):
        b.fill(cache, "bg", tokens)
        b.sync()
        t = time.perf_counter()
        cache.swap_out(["bg"])  # returns once the copies are queued on the side stream (CUDA)
        issue.append((time.perf_counter() - t) * 1e3)
        steps = []
        while True:
            steps.append(step_ms())
            if cache.host_tier.cuda is False or all(ev.query() for ev, _ in cache._held):
                break
        during.append(steps)
        cache.wait_host_tier()
        cache.free("bg")
        bases.append(alone())
    ref = [statistics.median(bases[r] + bases[r + 1]) for r in range(rounds)]
    per_round = [statistics.mean(d) / m - 1 for d, m in zip(during, ref)]
    with_issue = [(sum(d) + i) / len(d) / m - 1 for d, i, m in zip(during, issue, ref)]
    gpu_ms = statistics.median(ref)
    flat = [x for d in during for x in d]
    return dict(op="decode_during_swap_out", scheme=kv, host_fraction=None, B=len(ids), context=L,
                ms=statistics.mean(flat), bytes=-(-tokens // cache.page_size) * page_bytes(cache), bw_fraction=None,
                gpu_ms=gpu_ms, steps=len(flat), rounds=rounds, slowdown=statistics.median(per_round),
                slowdown_rounds=per_round, issue_ms=statistics.mean(issue),
                slowdown_with_issue=statistics.median(with_issue), step_ms=during, base_ms=bases)


def page_bytes(cache, pool: str = "compressed") -> int:
    """Bytes of one page over every layer."""
    from kvgen.runtime.pools import page_bytes as one

    return sum(one(cache.page_pool.named(layer, pool)) for layer in range(cache.num_layers))


def run(args) -> dict:
    from kvgen.planner.host_cost import host_step_cost

    b = Bench(args.smoke)
    torch = b.torch
    pinned = b.pinned(args.pinned_bytes)
    log(f"pinned h2d {pinned['h2d'] / 1e9:.1f} GB/s, d2h {pinned['d2h'] / 1e9:.1f} GB/s")
    records = [dict(op="pinned_h2d", scheme=None, host_fraction=None, ms=args.pinned_bytes / pinned["h2d"] * 1e3,
                    bytes=args.pinned_bytes, bw_fraction=1.0),
               dict(op="pinned_d2h", scheme=None, host_fraction=None, ms=args.pinned_bytes / pinned["d2h"] * 1e3,
                    bytes=args.pinned_bytes, bw_fraction=1.0)]
    for kv in (args.schemes.split(",") if "tier" in args.parts else []):
        B, L, S = args.batch, args.context, args.swap_tokens
        cold_max = int(0.75 * B * L) + B * 64
        Bg = args.bg_batch
        cache = b.cache(kv, max_tokens=max(B * L + S, Bg * L + S // 2) + Bg * 256, host_tokens=S + cold_max + 1024,
                        staging_tokens=cold_max, max_seqs=max(B, Bg) + 2)
        P = cache.page_size
        log(f"{kv}: {cache}")
        # -- swap a long sequence out and back in
        b.fill(cache, "long", S)
        pages = len(cache.block_manager.block_table("long"))
        nbytes = pages * page_bytes(cache)  # (a residual scheme's tail pages are a rounding error)
        for op, fn, bw in (("swap_out", lambda: (cache.swap_out(["long"]), cache.wait_host_tier()), pinned["d2h"]),
                           ("swap_in", lambda: cache.swap_in(["long"]), pinned["h2d"])):
            ms = b.timed(fn)
            rec = dict(op=op, scheme=kv, host_fraction=1.0, tokens=S, ms=ms, bytes=nbytes,
                       bw_fraction=nbytes / (ms * 1e-3) / bw)
            log(json.dumps(rec))
            records.append(rec)
        cache.free("long")  # its pages would leave the background swap-out below no room
        # -- decode with a fraction of every sequence's pages on the host
        ids = [f"s{i}" for i in range(B)]
        for sid in ids:
            b.fill(cache, sid, L)
        qkv = b.qkv(cache, B)
        gpu_ms = None
        for frac in (0.0, 0.25, 0.5, 0.75):
            cache.swap_in(ids)  # back to all-device, then the fraction cold
            cold = 0
            for sid in ids:
                n = min(int(frac * L) // P, cache.block_manager.num_compressed(sid))
                cache.make_cold(sid, n)
                cold += n
            cache.wait_host_tier()
            b.decode_step(cache, ids, qkv)  # warm-up (first use of the shape)
            ms = b.steps_ms(lambda: b.decode_step(cache, ids, qkv), args.repeat)
            gpu_ms = ms if frac == 0 else gpu_ms
            moved = cold * page_bytes(cache)
            transfer_ms = moved / pinned["h2d"] * 1e3
            bound = max(gpu_ms, transfer_ms)
            resident = sum(len(cache.block_manager.block_table(sid)) for sid in ids) * page_bytes(cache) - moved
            pred = host_step_cost(resident, moved, b.memory_bandwidth, pinned["h2d"], cache.num_layers)
            rec = dict(op="decode_host", scheme=kv, host_fraction=frac, B=B, context=L, ms=ms, bytes=moved,
                       bw_fraction=moved / (ms * 1e-3) / pinned["h2d"], gpu_ms=gpu_ms, transfer_ms=transfer_ms,
                       bound_ms=bound, ratio=ms / bound, predicted_ms=pred.step_ms,
                       predicted_gpu_ms=pred.gpu_ms, prediction_error=ms / pred.step_ms - 1)
            log(json.dumps(rec))
            records.append(rec)
        # -- decode while another sequence swaps out in the background (a batch large enough that the step
        # is bound by the GPU, not by the runtime API's per-layer host work: only then does interference show)
        cache.swap_in(ids)
        bg_ids = ids + [f"b{i}" for i in range(args.bg_batch - B)]
        for sid in bg_ids[B:]:
            b.fill(cache, sid, L)
        rec = background_swap(b, cache, kv, bg_ids, L, S // 2, rounds=args.bg_rounds, repeat=args.repeat)
        log(json.dumps(rec))
        records.append(rec)
        for sid in bg_ids[B:]:
            cache.free(sid)
        del cache
        if b.device.type == "cuda":
            torch.cuda.empty_cache()
    if "engine" in args.parts:
        from benchmarks.host_tier_engine import engine_records

        records += engine_records(smoke=args.smoke, kv=args.engine_kv, num_requests=args.engine_requests,
                                  prompt=args.engine_prompt, output=args.engine_output, ratio=args.engine_ratio)
    return dict(memory_bandwidth=b.memory_bandwidth, pinned_h2d=pinned["h2d"], pinned_d2h=pinned["d2h"], records=records)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary(result: dict) -> str:
    """The run's records as one compact table (what the done-when asks of each), for the tail of the output."""
    lines = [f"pinned h2d {result['pinned_h2d'] / 1e9:.1f} GB/s, d2h {result['pinned_d2h'] / 1e9:.1f} GB/s; "
             f"planner device read {result['memory_bandwidth'] / 1e12:.2f} TB/s",
             f"{'op':<24}{'scheme':<7}{'host':>5}{'ms':>11}{'GB':>8}{'bw_frac':>8}{'bound_ms':>10}{'ratio':>7}"
             f"{'pred_ms':>10}{'pred_err':>9}  notes"]
    for r in result["records"]:
        if r["op"].startswith("pinned"):
            continue
        notes = ""
        if r["op"] == "decode_during_swap_out":
            notes = (f"slowdown {r['slowdown']:+.1%} over {r['steps']} steps (gpu_ms {r['gpu_ms']:.3f}); "
                     f"swap_out call {r['issue_ms']:.1f} ms ({r['slowdown_with_issue']:+.1%} counting it)")
        elif r["op"].startswith("engine_"):
            notes = (f"{r['tokens_per_s']:.0f} tok/s, {r['generated']} tokens in {r['wall_s']:.2f} s, "
                     f"{r['num_preemptions']} preemptions, swapped out/in {r['swapped_out']}/{r['swapped_in']}, "
                     f"failures {r['swap_failures']}, kv_ratio {r['kv_ratio']:.2f}")
        lines.append(
            f"{r['op']:<24}{r.get('scheme') or '-':<7}{_fmt(r.get('host_fraction'), '.2f'):>5}{r['ms']:>11.3f}"
            f"{_fmt(r['bytes'] / 1e9 if r.get('bytes') else None, '.2f'):>8}{_fmt(r.get('bw_fraction'), '.3f'):>8}"
            f"{_fmt(r.get('bound_ms'), '.3f'):>10}{_fmt(r.get('ratio'), '.3f'):>7}{_fmt(r.get('predicted_ms'), '.3f'):>10}"
            f"{_fmt(r.get('prediction_error'), '+.1%'):>9}  {notes}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreted kernels)")
    ap.add_argument("--schemes", default=None, help="default bf16,int4 (smoke: fp32,int4)")
    ap.add_argument("--batch", type=int, default=None, help="decode batch (default 8; smoke 2)")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 16384; smoke 64)")
    ap.add_argument("--swap-tokens", type=int, default=None, help="swapped sequence (default 100000; smoke 256)")
    ap.add_argument("--bg-batch", type=int, default=None,
                    help="decode batch while a sequence swaps out (default 32; smoke 2)")
    ap.add_argument("--bg-rounds", type=int, default=5, help="background swap-outs timed (default 5)")
    ap.add_argument("--repeat", type=int, default=None, help="timed decode steps (default 10; smoke 1)")
    ap.add_argument("--parts", default="tier,engine",
                    help="tier (pinned, swaps, decode_host, background swap) and/or engine (default both)")
    ap.add_argument("--engine-kv", default="bf16", help="engine part's KV scheme (default bf16; smoke fp32)")
    ap.add_argument("--engine-requests", type=int, default=None, help="engine requests (default 64; smoke 4)")
    ap.add_argument("--engine-prompt", default=None, help="prompt tokens MIN,MAX (default 1024,2048; smoke 4,10)")
    ap.add_argument("--engine-output", default=None, help="output tokens MIN,MAX (default 64,128; smoke 8,12)")
    ap.add_argument("--engine-ratio", type=float, default=2.0, help="workload KV over the device budget (default 2)")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/<date>-host-tier.json)")
    args = ap.parse_args(argv)
    s = args.smoke
    args.schemes = args.schemes or ("fp32,int4" if s else "bf16,int4")
    args.batch = args.batch or (2 if s else 8)
    args.context = args.context or (64 if s else 16384)
    args.swap_tokens = args.swap_tokens or (256 if s else 100_000)
    args.repeat = args.repeat or (1 if s else 10)
    args.bg_batch = max(args.bg_batch or (2 if s else 32), args.batch)
    args.pinned_bytes = 2**20 if s else 2**30
    args.parts = set(args.parts.split(","))
    if not args.parts <= {"tier", "engine"}:
        ap.error(f"--parts takes tier and/or engine, got {sorted(args.parts)}")
    if s and args.engine_kv == "bf16":
        args.engine_kv = "fp32"  # no bfloat16 under the interpreter
    args.engine_requests = args.engine_requests or (4 if s else 64)
    args.engine_prompt = tuple(int(x) for x in (args.engine_prompt or ("4,10" if s else "1024,2048")).split(","))
    args.engine_output = tuple(int(x) for x in (args.engine_output or ("8,12" if s else "64,128")).split(","))
    if s:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if not s and not torch.cuda.is_available():
        log("the host tier benchmark needs a CUDA GPU; use --smoke on the CPU")
        return 2
    result = run(args)
    date = datetime.date.today().isoformat()
    gpu = "cpu" if s else torch.cuda.get_device_name()
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"{date}-host-tier{'-smoke' if s else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, date=date,
                                   command="python -m benchmarks.host_tier " + " ".join(argv or sys.argv[1:]),
                                   **result), indent=1) + "\n")
    log(f"wrote {out}")
    print(summary(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
