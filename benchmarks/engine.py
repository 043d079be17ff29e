"""Engine benchmark (GPU, one process): decode step time vs roofline and HF, offline throughput, KV-bound case, TTFT.

    python -m benchmarks.engine [--quick] [--out benchmarks/results/engine.json]

A Llama-3-8B-shaped model with random bf16 weights (no download). Parts
(issue 14, item 6):

(a) ``step``: ms per decode step of the engine at B=1/16K and B=32/2K for
    each KV scheme (the median of ``STEP_ROUNDS`` timed rounds, each kept in
    ``ms_rounds``, after ``STEP_WARMUP`` untimed steps), with the roofline ``(weight bytes + KV bytes read) /
    copy bandwidth`` (bandwidth measured in this run), and HF ``generate``
    (dynamic cache; static cache + torch.compile unless --no-hf-static) at
    the same shapes.
(b) ``throughput``: 1,000 requests, prompts 512-2,048 and outputs 128-512
    tokens (uniform, seeded): generated tokens/s and peak concurrent
    sequences per scheme; HF ``generate`` with static batches of 32 over the
    first ``--hf-requests`` requests.
(c) ``throughput`` with ``context`` 32768: equal KV memory (``--kv-bound-gb``)
    for every scheme, 32K-token prompts then ``--kv-bound-output`` tokens
    each: int4 fits ~3x bf16's. Besides the end-to-end ``tokens_per_s``
    (which the 32K-token prefills dominate, and they cost the same for
    every scheme), ``decode_tokens_per_s`` counts the steps that only decode
    (the phase the KV budget bounds) and ``decode_share`` their part of the
    run.
(d) ``ttft``: time to first token of a 16K-token prompt (the median of three, ``runs_ms`` each), after a
    warm-up prompt of the same length.

JSON: ``{gpu, torch, triton, copy_bandwidth, date, records: [...]}``; each
record has ``kind``, ``engine``, ``kv``, ``B`` or ``requests``, ``context``,
``ms``, ``roofline_ms`` (steps), ``tokens_per_s`` (throughput). A PNG of the
step and throughput records goes next to the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.offline import run_offline
from benchmarks.run import copy_bandwidth
from kvgen.atomic import write_atomic
from kvgen.engine.config import DEFAULT_ENGINE_BACKEND

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192))

STEP_WARMUP = 4
"""Untimed decode steps before the step part's rounds (a graph's first replays upload it)."""
STEP_ROUNDS = 3


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


KERNEL_BACKEND = DEFAULT_ENGINE_BACKEND
"""The kvgen engines' kernel language (``--kernel-backend``; recorded in the JSON's top level)."""


def make_engine(kv: str, *, max_model_len: int, max_num_seqs: int, max_tokens: int | None = None, eager=False,
                async_scheduling: bool = False):
    from kvgen.engine.loader import build_engine

    return build_engine(config=LLAMA3_8B, kv=kv, dtype="bfloat16", device="cuda", max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_tokens=max_tokens, enforce_eager=eager,
                        async_scheduling=async_scheduling, kernel_backend=KERNEL_BACKEND)


def release(holder: list) -> None:
    """Drop the engine in ``holder`` (the only reference) and give its GPU memory back before the next one."""
    holder.clear()
    gc.collect()
    torch.cuda.empty_cache()


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def run_until(engine, cond, max_steps=10**7) -> int:
    n = 0
    while not cond() and n < max_steps:
        engine.step()
        n += 1
    return n


def filled_engine(kv: str, B: int, L: int, max_model_len: int, *, async_scheduling: bool = False,
                  max_num_seqs: int | None = None):
    """``make_engine`` with B sequences of L random tokens, prefilled (chunked) up to each one's last token: its
    next ``step`` decodes them all, and they keep decoding (greedy, no EOS) up to ``max_model_len``.
    ``max_num_seqs``: default B (room for more lets a test add requests beside them)."""
    from kvgen.engine import SamplingParams

    eng = make_engine(kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs or B,
                      async_scheduling=async_scheduling)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_model_len - L - 8, ignore_eos=True)
    for _ in range(B):
        eng.add_request(None, [rng.randrange(1000, 100000) for _ in range(L)], params)
    run_until(eng, lambda: all(s.num_computed >= len(s.tokens) - 1 for s in eng.scheduler.running)
              and not eng.scheduler.waiting)
    return eng


def timed_steps(eng, steps: int) -> float:
    """Wall ms per engine step over ``steps`` steps, the GPU drained before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / steps


def step_rounds(eng, steps: int) -> list[float]:
    """``STEP_WARMUP`` untimed steps (each graph's first replays, which upload it, and whatever else a first step
    does once), then ``STEP_ROUNDS`` rounds of :func:`timed_steps`."""
    for _ in range(STEP_WARMUP):
        eng.step()
    return [timed_steps(eng, steps) for _ in range(STEP_ROUNDS)]


def step_records(kvs, shapes, bw, steps, hf_static, async_scheduling=False, hf=True) -> list[dict]:
    """kvgen's decode step per (shape, KV) and, with ``hf``, HF ``generate``'s (dynamic; static too with
    ``hf_static``) in the same process."""
    from kvgen.engine import gemv

    out = []
    for B, L in shapes:
        for kv in kvs:
            total = STEP_WARMUP + STEP_ROUNDS * steps
            eng = filled_engine(kv, B, L, L + total + 64, async_scheduling=async_scheduling)
            rounds = step_rounds(eng, steps)
            ms = statistics.median(rounds)
            kv_bytes = B * (L + STEP_WARMUP + STEP_ROUNDS * steps // 2) * eng.plan.kv_bytes_per_token
            roof = (weight_bytes(eng) + kv_bytes) / bw * 1e3
            # (no local name for the graphs: it would keep the engine's model and cache alive past release)
            choices = [c.describe() for c in getattr(getattr(eng.runner, "graphs", None), "gemv_choices", [])]
            rec = dict(kind="step", engine="kvgen", kv=kv, B=B, context=L, ms=ms, ms_rounds=rounds, roofline_ms=roof,
                       vs_roofline=ms / roof, graph_steps=eng.runner.graph_steps, async_scheduling=async_scheduling,
                       async_steps=eng.num_async_steps, gemv=gemv.enabled(),
                       gemv_choices=choices)
            log(json.dumps(rec))
            out.append(rec)
            holder = [eng]
            del eng
            release(holder)
        if hf:
            out.extend(hf_step_records(B, L, bw, steps, hf_static))
    return out


def hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def hf_step_records(B, L, bw, steps, static) -> list[dict]:
    out = []
    try:
        model = hf_model()
    except Exception as e:  # transformers missing or OOM: the kvgen numbers still stand
        log(f"hf model failed: {e}")
        return out
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(1000, 100000, (B, L), device="cuda")
    for name, kw in (("hf-dynamic", {}), ("hf-static", {"cache_implementation": "static"}) if static else (None, None)):
        if name is None:
            continue
        try:
            def gen(n):
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
                torch.cuda.synchronize()
                return time.perf_counter() - t
            gen(2)
            short, long = gen(2), gen(2 + steps)
            ms = (long - short) * 1e3 / steps
            kv_bytes = B * (L + steps // 2) * 2 * 32 * 8 * 128 * 2
            rec = dict(kind="step", engine=name, kv="bf16", B=B, context=L, ms=ms,
                       roofline_ms=(wbytes + kv_bytes) / bw * 1e3)
            log(json.dumps(rec))
            out.append(rec)
        except Exception as e:
            log(f"{name} failed at B={B} L={L}: {e}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def workload(n: int, seed: int = 0, prompt=(512, 2048), output=(128, 512)):
    rng = random.Random(seed)
    return [([rng.randrange(1000, 100000) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def throughput_record(kv, reqs, *, max_model_len, max_num_seqs, max_tokens=None, context=None, label="kvgen",
                      async_scheduling=False):
    eng = make_engine(kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_tokens=max_tokens,
                      async_scheduling=async_scheduling)
    phases: dict = {}
    generated, s = run_offline(eng, reqs, torch.cuda.synchronize, phases)
    rec = dict(kind="throughput", engine=label, kv=kv, requests=len(reqs), context=context, ms=s * 1e3,
               tokens_per_s=generated / s, peak_concurrent=eng.peak_running, preemptions=eng.scheduler.num_preemptions,
               capacity_tokens=eng.cache.capacity_tokens, output_tokens=[min(m for _, m in reqs), max(m for _, m in reqs)],
               decode_steps=phases["decode_steps"], decode_share=phases["decode_s"] / s if s else None,
               decode_tokens_per_s=phases["decode_tokens"] / phases["decode_s"] if phases["decode_s"] else None,
               async_scheduling=async_scheduling, async_steps=eng.num_async_steps)
    log(json.dumps(rec))
    holder = [eng]
    del eng
    release(holder)
    return rec


def hf_throughput_record(reqs, batch=32) -> dict | None:
    try:
        model = hf_model()
    except Exception as e:
        log(f"hf model failed: {e}")
        return None
    generated = 0
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device="cuda")
        n = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        generated += sum(m for _, m in chunk)  # tokens the requests asked for (the batch runs to the longest)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    rec = dict(kind="throughput", engine="hf-dynamic", kv="bf16", requests=len(reqs), context=None, ms=s * 1e3,
               tokens_per_s=generated / s, batch=batch)
    log(json.dumps(rec))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def ttft_record(kv, L) -> dict:
    from kvgen.engine import SamplingParams

    eng = make_engine(kv, max_model_len=L + 16, max_num_seqs=1)
    # warm-up: a whole prompt of the same length and other tokens (no prefix hit), so that every kernel the timed
    # prompt runs has been compiled and tuned -- later chunks read a cached prefix, which a quantized cache stages
    # (a 512-token warm-up, one chunk, left those first uses inside the timed prompt: int4 1.7 s against 0.47)
    warm = [random.Random(2).randrange(1000, 100000) for _ in range(L)]
    eng.add_request("warm", warm, SamplingParams(max_tokens=1))
    run_until(eng, lambda: not eng.has_unfinished_requests())
    runs = []
    for seed in (1, 3, 4):  # three prompts, each its own tokens (no prefix hit): the median is the record
        prompt = [random.Random(seed).randrange(1000, 100000) for _ in range(L)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.add_request(f"ttft{seed}", prompt, SamplingParams(max_tokens=1))
        run_until(eng, lambda: not eng.has_unfinished_requests())
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) * 1e3)
    rec = dict(kind="ttft", engine="kvgen", kv=kv, B=1, context=L, ms=statistics.median(runs), runs_ms=runs)
    log(json.dumps(rec))
    holder = [eng]
    del eng
    release(holder)
    return rec


def plot(records, path):
    """One bar panel per record kind present (decode step ms against its roofline, tokens/s, TTFT ms)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return

    def label(r):
        size = f"B{r['B']} L{r['context']}" if r["kind"] != "throughput" else \
            f"{r['requests']} req, ctx {r['context'] or '512-2K'}"
        return f"{r['engine']} {r['kv']}\n{size}"

    panels = [(k, y, [r for r in records if r["kind"] == k])
              for k, y in (("step", "ms per decode step"), ("throughput", "generated tokens / s"),
                           ("ttft", "ms to first token"))]
    panels = [p for p in panels if p[2]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (kind, ylabel, rs) in zip(axes[0], panels):
        ax.bar(range(len(rs)), [r["tokens_per_s"] if kind == "throughput" else r["ms"] for r in rs],
               label="measured")
        if kind == "step":
            ax.scatter(range(len(rs)), [r["roofline_ms"] for r in rs], color="k", marker="_", s=400, label="roofline")
            ax.set_yscale("log")
            ax.legend()
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([label(r) for r in rs], fontsize=7, rotation=60)
        ax.set_ylabel(ylabel)
    fig.suptitle("kvgen engine, Llama-3-8B shape, random bf16 weights")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_shape(text: str) -> tuple[int, int]:
    """``"32x2048"`` -> ``(32, 2048)``: batch x context."""
    b, _, l = text.strip().partition("x")
    if not (b.isdigit() and l.isdigit()) or int(b) < 1 or int(l) < 1:
        raise SystemExit(f"a step shape is BxL with positive integers (e.g. 32x2048), got {text!r}")
    return int(b), int(l)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes and counts (minutes)")
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    ap.add_argument("--kv", default="bf16,int8,int4")
    ap.add_argument("--parts", default="step,throughput,kvbound,ttft")
    ap.add_argument("--hf-requests", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-hf-static", action="store_true")
    ap.add_argument("--kv-bound-gb", type=float, default=16.0)
    ap.add_argument("--kv-bound-output", type=int, default=512,
                    help="output tokens of each KV-bound request (its decode phase; the 32K prompt is the same)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="step part: time kvgen's steps with async scheduling too (records with async_scheduling "
                         "true); kvbound part: its engines schedule asynchronously (end-to-end tokens/s; the "
                         "decode-phase figures then blur a phase change, see benchmarks/offline.py)")
    from kvgen.engine.config import ENGINE_BACKENDS

    ap.add_argument("--async-only", action="store_true",
                    help="step part: only the async-scheduling steps (no synchronous ones, no HF)")
    ap.add_argument("--gemv-ab", action="store_true",
                    help="step part: time every kvgen step with the small-batch GEMV off (KVGEN_GEMV=0, cuBLAS "
                         "everywhere) and then on, in this process (records with gemv false/true)")
    ap.add_argument("--step-shapes", default=None,
                    help="step part: BxL shapes to time instead of the issue's 1x16384,32x2048 (e.g. 1x16384)")
    ap.add_argument("--kernel-backend", default=DEFAULT_ENGINE_BACKEND, choices=ENGINE_BACKENDS,
                    help="the kvgen engines' kernels (cuda: the CUDA decode kernel where the scheme has one)")
    ap.add_argument("--autotune", choices=("cached", "sync"), default=None,
                    help="KVGEN_AUTOTUNE for the kvgen engines: cached (the default a user gets: remembered winners, "
                         "else the autotuner's model) or sync (every config the engine looks up is timed on first "
                         "use, the graphs' included; what kvgen tune on these shapes would leave)")
    args = ap.parse_args(argv)
    import triton

    global KERNEL_BACKEND
    KERNEL_BACKEND = args.kernel_backend
    if args.autotune is not None:
        os.environ["KVGEN_AUTOTUNE"] = args.autotune

    kvs = args.kv.split(",")
    parts = set(args.parts.split(","))
    q = args.quick
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    records: list[dict] = []
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bandwidth=bw, date=datetime.datetime.now(datetime.timezone.utc).isoformat(), quick=q,
               kernel_backend=KERNEL_BACKEND, autotune=os.environ.get("KVGEN_AUTOTUNE") or "cached", records=records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_atomic(out, json.dumps(doc, indent=1))

    def attempt(fn, *a, **kw):
        try:
            r = fn(*a, **kw)
        except Exception as e:  # one failing part must not lose the rest
            log(f"{getattr(fn, '__name__', fn)} failed: {type(e).__name__}: {e}")
            return
        if isinstance(r, list):
            records.extend(r)
        elif r is not None:
            records.append(r)
        save()

    if "step" in parts:
        shapes = [(1, 4096), (8, 1024)] if q else [(1, 16384), (32, 2048)]
        if args.step_shapes:
            shapes = [parse_shape(s) for s in args.step_shapes.split(",")]
        n = 16 if q else 64
        if not args.async_only:
            attempt(step_records, kvs, shapes, bw, n, not (q or args.no_hf_static or args.no_hf), hf=not args.no_hf)
        if args.async_scheduling or args.async_only:
            for switch in ("0", "1") if args.gemv_ab else (os.environ.get("KVGEN_GEMV", "1"),):
                os.environ["KVGEN_GEMV"] = switch
                attempt(step_records, kvs, shapes, bw, n, False, async_scheduling=True, hf=False)
    if "throughput" in parts:
        reqs = workload(64 if q else 1000, prompt=(128, 512) if q else (512, 2048), output=(32, 128) if q else (128, 512))
        for kv in kvs:
            attempt(throughput_record, kv, reqs, max_model_len=4096, max_num_seqs=256)
        if not args.no_hf:
            attempt(hf_throughput_record, reqs[:min(len(reqs), 32 if q else args.hf_requests)])
    if "kvbound" in parts:
        ctx = 8192 if q else 32768
        budget = (2 if q else args.kv_bound_gb) * 2**30
        out_len = 64 if q else args.kv_bound_output
        for kv in kvs:
            def kv_bound(kv=kv):
                # one sequence's engine only to read the scheme's bytes per token (the planner refuses 256
                # sequences of 32K tokens: more than the GPU and the host tier hold)
                eng = make_engine(kv, max_model_len=ctx + out_len + 64, max_num_seqs=1,
                                  max_tokens=ctx + out_len + 64)
                per_token = eng.plan.kv_bytes_per_token
                holder = [eng]
                del eng
                release(holder)
                cap = int(budget // per_token)
                n = max(1, cap // (ctx + out_len))
                reqs = workload(2 * n, seed=2, prompt=(ctx - 64, ctx), output=(out_len, out_len))
                # max_num_seqs = every request: the KV budget, not the sequence limit, bounds concurrency
                return throughput_record(kv, reqs, max_model_len=ctx + out_len + 64, max_num_seqs=len(reqs),
                                         max_tokens=cap, context=ctx, async_scheduling=args.async_scheduling)
            attempt(kv_bound)
    if "ttft" in parts:
        for kv in kvs:
            attempt(ttft_record, kv, 4096 if q else 16384)
    save()
    try:
        plot(records, out.with_suffix(".png"))
    except Exception as e:  # the JSON is the result; a plot failure must not hide it
        log(f"plot failed: {e}")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
