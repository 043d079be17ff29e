"""The engine at tp = 1, 2, 4, 8 (as many GPUs as lent): decode step time and throughput, Llama-3-70B shape.

    python -m benchmarks.tp_engine [--tps 1,2,4,8] [--kv bf16,int4] [--layers 80] [--quick]
                                   [--out benchmarks/results/tp_engine.json]
    python -m benchmarks.tp_engine --tiny --device cpu --tps 1,2 --kv fp32 --out /tmp/tp_engine.json  # smoke

A random-weight model of Llama-3-70B's shape (hidden 8192, 64 query / 8 KV
heads of 128, intermediate 28672, vocab 128256; ``--layers`` of the 80) in
bfloat16, through ``build_engine(config=..., tp=N)``: rank 0 is this
process, ranks 1..N-1 are the engine's worker processes (NCCL, rank r on
cuda:r), NVLink multicast off in every one of them (``NO_MULTICAST``, also
set here before torch loads). For each tp and KV scheme:

- ``step``: ms per decode step at each ``--shapes`` BxL (B sequences of L
  tokens, prefilled first; CUDA graphs unless ``--eager``), with the
  per-GPU roofline ``(weight bytes of a rank + KV bytes a rank reads) /
  copy bandwidth`` (bandwidth measured here; the all-reduces are not in it);
- ``throughput``: ``--requests`` requests, prompts 512-2,048 and outputs
  128-512 tokens (uniform, seeded), generated tokens/s and peak concurrent
  sequences, KV pages capped at ``--kv-gb`` per GPU.

Before them (``--parts equivalence``): stories260K (tests/assets) greedy
through the engine at tp=1 and at each tp > 1: float32 (expected: token
for token) and bfloat16 (matching tokens and the relative L2 error of the
logits over the steps before the first differing token).

A tp whose weights do not fit a GPU (tp=1 at 80 layers) is recorded as
skipped with the reason. JSON: ``{gpu, gpus, torch, triton, copy_bandwidth,
date, layers, records}``, each record with ``kind``, ``engine`` (kvgen),
``tp``, ``kv``, ``B``/``requests``, ``context``, ``ms``, ``roofline_ms``
(steps), ``tokens_per_s`` (throughput); a table of them at the end. Run
``python -m benchmarks.tp_scaling`` in the same call for the kernel-level
scaling and the NCCL equivalence.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

from kvgen.atomic import write_atomic
from kvgen.engine.config import DEFAULT_ENGINE_BACKEND  # the backend the engines here are asked for (recorded)
from kvgen.engine.parallel import NO_MULTICAST  # torch-free

os.environ.update(NO_MULTICAST)  # before torch or NCCL load in this process

LLAMA3_70B = dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192))
# The same structure at stories260K's size (8 query / 4 KV heads: tp 8 replicates KV heads): CPU smoke runs.
TINY = dict(LLAMA3_70B, vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, torch_dtype="float32",
            rope_scaling=None)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
WEIGHT_HEADROOM = 0.8  # weights may take this share of a GPU: the rest is KV, activations and graphs
STORIES = Path(__file__).resolve().parents[1] / "tests" / "assets" / "models" / "stories260K"
PROMPT = "Once upon a time, there was a little"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_config(layers: int | None = None, tiny: bool = False) -> dict:
    cfg = dict(TINY if tiny else LLAMA3_70B)
    if layers is not None:
        cfg["num_hidden_layers"] = int(layers)
    return cfg


def _shapes(config: dict) -> tuple[int, int, int, int, int, int, int]:
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // hq
    return H, I, V, hq, hkv, D, config["num_hidden_layers"]


def param_count(config: dict) -> int:
    """Parameters of the whole model (no biases: Llama)."""
    H, I, V, hq, hkv, D, L = _shapes(config)
    per_layer = H * (hq * D) + 2 * H * (hkv * D) + (hq * D) * H + 3 * H * I + 2 * H
    heads = V * H * (1 if config.get("tie_word_embeddings") else 2)
    return L * per_layer + heads + H


def weight_bytes_per_rank(config: dict, tp: int, dtype_bytes: int) -> int:
    """Bytes of weights on the largest rank: embeddings, head and norms whole, layers sharded as the engine does.

    KV heads are replicated when tp exceeds them; intermediate channels
    are split as evenly as possible (the largest share counts).
    """
    H, I, V, hq, hkv, D, L = _shapes(config)
    q = hq // tp
    kv = max(1, hkv // tp)
    inter = -(-I // tp)
    per_layer = H * (q * D) + 2 * H * (kv * D) + (q * D) * H + 3 * H * inter + 2 * H
    heads = V * H * (1 if config.get("tie_word_embeddings") else 2)
    return (L * per_layer + heads + H) * dtype_bytes


def tps_to_run(requested: list[int], gpus: int) -> list[int]:
    """The requested tps that this machine's GPUs can host, in order."""
    return [t for t in requested if 1 <= t <= gpus]


def roofline_ms(weight_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """Time to read every weight and the step's KV once at ``bandwidth`` bytes/s (per GPU, no communication)."""
    return (weight_bytes + kv_bytes) / bandwidth * 1e3


def workload(n: int, seed: int = 0, prompt=(512, 2048), output=(128, 512), vocab: int = 100000):
    rng = random.Random(seed)
    low = min(1000, vocab // 4)
    return [([rng.randrange(low, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def table(records: list[dict]) -> str:
    """One line per record; ``speedup`` against the smallest tp of the same kind, kv and shape."""
    base: dict[tuple, float] = {}
    for r in sorted((r for r in records if "skipped" not in r and "error" not in r and r["kind"] != "equivalence"),
                    key=lambda r: r["tp"]):
        key = (r["kind"], r["kv"], r.get("B"), r.get("context"), r.get("requests"))
        metric = r["ms"] if r["kind"] == "step" else -r["tokens_per_s"]
        base.setdefault(key, metric)
    lines = [f"{'kind':<10} {'tp':>2} {'kv':<5} {'shape':<14} {'ms/step':>9} {'roof ms':>8} {'tok/s':>9} "
             f"{'speedup':>7}"]
    for r in records:
        if r["kind"] == "equivalence":
            lines.append(f"{'equal?':<10} {r['tp']:>2} {r['kv']:<5} "
                         + (r["error"] if "error" in r else f"{r['matching_tokens']}/{r['tokens']} tokens as tp=1, "
                            f"logits rel. L2 {r['logits_rel_l2']:.2e}"))
            continue
        shape = f"B={r.get('B')} L={r.get('context')}" if r["kind"] == "step" else f"{r.get('requests')} reqs"
        if "skipped" in r or "error" in r:
            lines.append(f"{r['kind']:<10} {r['tp']:>2} {r['kv']:<5} {shape:<14} {r.get('skipped') or r.get('error')}")
            continue
        key = (r["kind"], r["kv"], r.get("B"), r.get("context"), r.get("requests"))
        if r["kind"] == "step":
            speed = base[key] / r["ms"]
            lines.append(f"{'step':<10} {r['tp']:>2} {r['kv']:<5} {shape:<14} {r['ms']:>9.2f} {r['roofline_ms']:>8.2f} "
                         f"{r['B'] * 1e3 / r['ms']:>9.0f} {speed:>6.2f}x")
        else:
            speed = r["tokens_per_s"] / -base[key]
            lines.append(f"{'throughput':<10} {r['tp']:>2} {r['kv']:<5} {shape:<14} {'':>9} {'':>8} "
                         f"{r['tokens_per_s']:>9.0f} {speed:>6.2f}x")
    return "\n".join(lines)


def compare(ref: tuple[list[int], list], got: tuple[list[int], list]) -> dict:
    """Tokens and per-step logits of two greedy runs: equal tokens, the common prefix, logits' rel. L2 over it."""
    import torch

    (ref_ids, ref_logits), (ids, logits) = ref, got
    same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), min(len(ref_ids), len(ids)))
    steps = min(same + 1, len(ref_logits), len(logits))  # the step that drew the first differing token still counts
    a = torch.cat([x.double().flatten() for x in ref_logits[:steps]]) if steps else torch.zeros(1)
    b = torch.cat([x.double().flatten() for x in logits[:steps]]) if steps else torch.zeros(1)
    err = float((b - a).norm() / a.norm()) if steps else None
    return dict(tokens_equal=ref_ids == ids, matching_tokens=same, tokens=len(ref_ids), logits_rel_l2=err)


# --------------------------------------------------------------------------- measurements (need the engine)


def greedy_with_logits(tp: int, dtype: str, device: str, n: int, model: Path = STORIES) -> tuple[list[int], list]:
    """Greedy tokens of PROMPT through the engine at ``tp``, and the float32 logits of every step."""
    from kvgen.engine import SamplingParams
    from kvgen.engine.llm import LLM

    kv = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    with LLM(str(model), kv=kv, dtype=dtype, device=device, tp=tp, max_num_seqs=1, max_model_len=256,
             verbose=False) as llm:
        logits: list = []
        run = llm.engine.runner.run

        def capture(*a):
            out = run(*a)
            if out is not None:
                logits.append(out.float().cpu())
            return out

        llm.engine.runner.run = capture  # an instance attribute: this engine's runner only
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True))
    return out[0].outputs[0].token_ids, logits


def equivalence_records(tps: list[int], device: str, n: int) -> list[dict]:
    out = []
    dtypes = ["float32", "bfloat16"] if device == "cuda" else ["float32"]
    for dtype in dtypes:
        ref = greedy_with_logits(1, dtype, device, n)
        for tp in tps:
            if tp > 1:
                rec = dict(kind="equivalence", engine="kvgen", model="stories260K", dtype=dtype, tp=tp, kv=dtype,
                           **compare(ref, greedy_with_logits(tp, dtype, device, n)))
                log(json.dumps(rec))
                out.append(rec)
    return out




def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), as benchmarks.run measures it."""
    import torch

    if device == "cuda":
        from benchmarks.run import copy_bandwidth as cuda_bandwidth
        return cuda_bandwidth()
    src = torch.empty(2**24, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * src.numel() / (time.perf_counter() - t)


def make_engine(config: dict, tp: int, kv: str, device: str, *, max_model_len: int, max_num_seqs: int,
                max_tokens: int, eager: bool):
    from kvgen.engine.loader import build_engine

    return build_engine(config=config, kv=kv, dtype=config["torch_dtype"], device=device, tp=tp,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_tokens=max_tokens,
                        enforce_eager=eager, verbose=False)


def close(holder: list, device: str) -> None:
    """Stop the engine in ``holder`` (its workers too) and give its memory back before the next one."""
    import torch

    for eng in holder:
        eng.close()
    holder.clear()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def step_record(config: dict, tp: int, kv: str, B: int, L: int, steps: int, bw: float, device: str,
                eager: bool) -> dict:
    from kvgen.engine import SamplingParams

    max_len = L + steps + 64
    holder = [make_engine(config, tp, kv, device, max_model_len=max_len, max_num_seqs=B,
                          max_tokens=B * (max_len + 32), eager=eager)]
    eng = holder[0]
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
        for _ in range(B):
            eng.add_request(None, [rng.randrange(config["vocab_size"]) for _ in range(L)], params)
        while eng.scheduler.waiting or any(s.num_computed < len(s.tokens) - 1 for s in eng.scheduler.running):
            eng.step()  # prefill (chunked)
        eng.step()  # one warm decode step
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        _sync(device)
        ms = (time.perf_counter() - t) * 1e3 / steps
        kv_bytes = B * (L + steps // 2) * eng.plan.kv_bytes_per_token_per_gpu
        wb = weight_bytes(eng)
        return dict(kind="step", engine="kvgen", tp=tp, kv=kv, B=B, context=L, ms=ms,
                    roofline_ms=roofline_ms(wb, kv_bytes, bw), weight_bytes_per_gpu=wb,
                    kv_bytes_per_gpu=kv_bytes, graph_steps=eng.runner.graph_steps, steps=steps)
    finally:
        del eng
        close(holder, device)


def throughput_record(config: dict, tp: int, kv: str, reqs: list, kv_gb: float, device: str, eager: bool) -> dict:
    from benchmarks.offline import run_offline

    max_len = max(len(p) + n for p, n in reqs) + 16
    per_token = _plan_kv_bytes(config, tp, kv, device, max_len)
    max_tokens = max(int(kv_gb * 2**30 // per_token), max_len)
    holder = [make_engine(config, tp, kv, device, max_model_len=max_len, max_num_seqs=256, max_tokens=max_tokens,
                          eager=eager)]
    eng = holder[0]
    try:
        generated, s = run_offline(eng, reqs, lambda: _sync(device))
        return dict(kind="throughput", engine="kvgen", tp=tp, kv=kv, requests=len(reqs), context=None, ms=s * 1e3,
                    tokens_per_s=generated / s, peak_concurrent=eng.peak_running,
                    preemptions=eng.scheduler.num_preemptions, capacity_tokens=eng.cache.capacity_tokens)
    finally:
        del eng
        close(holder, device)


def _plan_kv_bytes(config: dict, tp: int, kv: str, device: str, context: int) -> int:
    """KV bytes per token on one rank, from the plan (no engine built)."""
    import types

    import torch
    from transformers import AutoConfig

    from kvgen.integrations.transformers import plan_for_model

    conf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    conf._name_or_path = f"random-{config['model_type']}"
    shim = types.SimpleNamespace(config=conf, dtype=getattr(torch, config["torch_dtype"]), device=torch.device(device))
    return plan_for_model(shim, kv, device=device, context=context, tp=tp).kv_bytes_per_token_per_gpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tps", default="1,2,4,8", help="tensor-parallel sizes; those above the GPU count are left out")
    ap.add_argument("--kv", default="bf16,int4")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's, 80)")
    ap.add_argument("--shapes", default="1x4096,32x2048", help="decode shapes BxL")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per shape")
    ap.add_argument("--requests", type=int, default=256, help="throughput requests (0: no throughput part)")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV pages per GPU for the throughput part (GiB; default 40, 0.01 on the CPU)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--quick", action="store_true", help="8 layers, one shape, 32 requests (minutes)")
    ap.add_argument("--tiny", action="store_true", help="a stories260K-sized model (CPU smoke runs)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--parts", default="equivalence,step,throughput")
    ap.add_argument("--equivalence-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/tp_engine.json")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    layers = 8 if args.quick and args.layers is None else args.layers
    config = model_config(layers, tiny=args.tiny)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    parts = set(args.parts.split(","))
    requests = args.requests if "throughput" in parts else 0
    if "step" not in parts:
        shapes = []
    kv_gb = args.kv_gb if args.kv_gb is not None else 40.0 if args.device == "cuda" else 0.01
    if args.quick:
        shapes, requests = shapes[-1:], min(requests, 32)
    prompt, output = ((512, 2048), (128, 512)) if not (args.quick or args.tiny) else ((16, 64), (4, 16))
    reqs = workload(requests, prompt=prompt, output=output, vocab=config["vocab_size"]) if requests else []
    gpus = torch.cuda.device_count() if args.device == "cuda" else 8
    tps = tps_to_run([int(t) for t in args.tps.split(",")], gpus)
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    dtype_bytes = DTYPE_BYTES[config["torch_dtype"]]
    bw = copy_bandwidth(args.device)
    import triton

    records: list[dict] = []
    doc = dict(gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", gpus=gpus, torch=torch.__version__,
               triton=triton.__version__, copy_bandwidth=bw,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               layers=config["num_hidden_layers"], model="tiny" if args.tiny else "llama-3-70b-shape",
               params=param_count(config), env=NO_MULTICAST, kernel_backend=DEFAULT_ENGINE_BACKEND, records=records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_atomic(out, json.dumps(doc, indent=1))

    def attempt(base: dict, fn, *a) -> None:
        try:
            rec = fn(*a)
        except Exception as e:  # one failing case must not lose the rest
            traceback.print_exc()
            rec = dict(base, error=f"{type(e).__name__}: {e}")
        log(json.dumps(rec))
        records.append(rec)
        save()

    log(f"tps {tps}, {config['num_hidden_layers']} layers, copy bandwidth {bw / 1e9:.0f} GB/s")
    if "equivalence" in parts and any(t > 1 for t in tps):
        try:
            records.extend(equivalence_records(tps, args.device, args.equivalence_tokens))
        except Exception as e:
            traceback.print_exc()
            records.append(dict(kind="equivalence", engine="kvgen", tp=max(tps), kv="-",
                                error=f"{type(e).__name__}: {e}"))
        save()
    for tp in tps:
        wb = weight_bytes_per_rank(config, tp, dtype_bytes)
        for kv in args.kv.split(","):
            if gpu_bytes is not None and wb > WEIGHT_HEADROOM * gpu_bytes:
                why = (f"weights {wb / 2**30:.0f} GiB per GPU exceed {WEIGHT_HEADROOM:.0%} of "
                       f"{gpu_bytes / 2**30:.0f} GiB")
                for B, L in shapes:
                    records.append(dict(kind="step", engine="kvgen", tp=tp, kv=kv, B=B, context=L, skipped=why))
                if reqs:
                    records.append(dict(kind="throughput", engine="kvgen", tp=tp, kv=kv, requests=len(reqs),
                                        skipped=why))
                save()
                continue
            for B, L in shapes:
                attempt(dict(kind="step", engine="kvgen", tp=tp, kv=kv, B=B, context=L), step_record, config, tp, kv,
                        B, L, args.steps, bw, args.device, args.eager)
            if reqs:
                attempt(dict(kind="throughput", engine="kvgen", tp=tp, kv=kv, requests=len(reqs)), throughput_record,
                        config, tp, kv, reqs, kv_gb, args.device, args.eager)
    save()
    print(table(records))
    bad = [r for r in records if "error" in r or (r["kind"] == "equivalence" and r["dtype"] == "float32"
                                                   and not r["tokens_equal"])]
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
