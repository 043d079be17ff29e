"""Tensor parallelism on several GPUs: NCCL equivalence and decode scaling, one command, one folder.

    python -m benchmarks.tp_scaling [--gpus N] [--out DIR]
    TRITON_INTERPRET=1 python -m benchmarks.tp_scaling --backend gloo --device cpu --gpus 2 --out /tmp/tp_smoke

Spawns N ranks (torch.multiprocessing; rank r on cuda:r, NCCL; or gloo on the
CPU with the Triton interpreter, a smoke test whose timings mean nothing) and:

a. equivalence: greedy ``generate()`` through kvgen with tp=1 (one process)
   and with tp=N (``shard_model`` + ``attach(tp_rank=, tp_size=)``):
   stories260K in float32 (expected: token for token) and, on CUDA, in
   bfloat16, and a random-weight Llama at a per-GPU-realistic shape (64/8
   heads, D=128, hidden 8192, 2 layers) in bfloat16. bfloat16 records the
   matching tokens and the logits' relative error against tp=1 rather than
   expecting equality (the all-reduce sums partial products in another
   order). Writes ``equivalence.json``.
b. decode scaling: the generated decode kernel at the Llama-3-70B attention
   shape (64 query / 8 KV heads, D=128, page 16) for B=32 sequences of
   L=4096 tokens, the same total batch for every tp, each rank holding
   Hq/tp and Hkv/tp heads. Every rank tunes over a short list of the
   kernel's candidates (the config with the lowest time on the slowest rank
   wins), then all ranks time it together after a barrier (median of
   triton.testing.do_bench on each); the step time is the slowest rank's.
   Writes ``tp_scaling.json`` (gpu, torch, triton, date, records) and prints
   the table last.

Each part keeps going when the other fails (its error is recorded in its
JSON); a part that outlives its deadline is stopped and keeps the records it
had written. Default output: ``benchmarks/results/<date>-<gpu>-x<N>/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.tp_equivalence import equivalence_table, equivalence_worker
from benchmarks.tp_ranks import (CPU_NOTE, SAFE_ENV, barrier, error_text, gather, run_header, setup_rank, spawn,
                                write_json)

REPO = Path(__file__).resolve().parents[1]
MODEL_DIRS = [REPO / "tests" / "assets" / "models" / "stories260K"]
SHAPE = dict(B=32, L=4096, Hq=64, Hkv=8, D=128)  # Llama-3-70B attention, the first ANCHORS shape of benchmarks/run.py
QUICK_SHAPE = dict(B=2, L=64, Hq=64, Hkv=8, D=128)
# Compiled variants tried (pages per tile, warps, stages), every split count of candidates() for each:
# a handful of compiles per kernel instead of a dozen (the H200 sweep's best were among these).
TUNE_VARIANTS = {(8, 4, 2), (4, 4, 2)}


# --------------------------------------------------------------------------- b. decode scaling


def _time(fn, dev: torch.device, rep_ms: int) -> float:
    """Median ms: triton.testing.do_bench on CUDA, a few wall-clock runs in the interpreter."""
    if dev.type == "cuda":
        from benchmarks.run import bench

        return bench(fn, rep_ms=rep_ms)
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _copy_bandwidth(dev: torch.device) -> float:
    if dev.type == "cuda":
        from benchmarks.run import copy_bandwidth

        return copy_bandwidth()
    src = torch.empty(32 * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), dev, 0)
    return 2 * src.numel() / (ms * 1e-3)


def _shortlist(mod, B: int, L: int, dev: torch.device, quick: bool) -> list[dict]:
    first = mod.default_config(B, L, dev)
    out = [first] + [c for c in mod.candidates(B, L)
                     if (c["pages_per_tile"], c["num_warps"], c["num_stages"]) in TUNE_VARIANTS and c != first]
    return out[:2] if quick else out


def _scaling_point(name: str, tp: int, rank: int, dev: torch.device, shape: dict, opts: dict) -> dict | None:
    """One (scheme, tp): ranks < tp each run B sequences over Hq/tp, Hkv/tp heads; every rank calls this."""
    from benchmarks.run import PAGE, DecodeCase, kernel_module, rel_l2

    B, L, Hq, Hkv, D = (shape[k] for k in ("B", "L", "Hq", "Hkv", "D"))
    hq, hkv = Hq // tp, Hkv // tp
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    active = rank < tp
    state = {}
    info = None
    if active:
        try:
            t0 = time.perf_counter()
            mod, scheme = kernel_module("decode", name, hkv, Hq // Hkv, D, dtype=str(dtype).split(".")[-1])
            case = DecodeCase(scheme, B, L, hq, hkv, D, dtype=dtype, seed=rank, device=dev)
            out = torch.empty_like(case.q)
            sm = 1 / math.sqrt(D)

            def run(cfg):
                mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, sm, cfg)

            cands = _shortlist(mod, B, L, dev, opts["quick"])
            times = []
            for cfg in cands:
                try:
                    times.append(_time(lambda: run(cfg), dev, 60))
                except Exception as exc:  # a candidate that does not compile (registers, smem) is skipped
                    print(f"    rank {rank} {name} tp{tp} candidate {cfg} failed: {error_text(exc)[:160]}", file=sys.stderr)
                    times.append(None)
            state = dict(case=case, run=run, out=out)
            info = {"configs": cands, "times": times, "tune_s": time.perf_counter() - t0}
        except Exception as exc:
            traceback.print_exc()
            info = {"error": error_text(exc)}
    infos = gather(info)[:tp]
    rec = dict(scheme=name, tp=tp, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE, q_heads_per_gpu=hq,
               kv_heads_per_gpu=hkv, dtype=str(dtype).split(".")[-1])
    errors = {f"rank{r}": i["error"] for r, i in enumerate(infos) if "error" in i}
    pick = None
    if not errors:
        configs = infos[0]["configs"]
        worst = [max((i["times"][c] if i["times"][c] is not None else math.inf) for i in infos)
                 for c in range(len(configs))]
        if min(worst) < math.inf:
            pick = min(range(len(configs)), key=worst.__getitem__)
        else:
            errors["all"] = "no tuning candidate ran"
    # Every rank launches the chosen config together, right after one barrier.
    barrier(opts, rank)
    result = None
    if active and pick is not None:
        try:
            case, run = state["case"], state["run"]
            cfg = infos[0]["configs"][pick]
            ms = _time(lambda: run(cfg), dev, 200)
            run(cfg)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            result = {"ms": ms, "bytes": case.bytes, "rel_error": rel_l2(state["out"].float(), case.reference())}
        except Exception as exc:
            traceback.print_exc()
            result = {"error": error_text(exc)}
    results = gather(result)[:tp]
    state.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if rank != 0:
        return None
    if pick is None:
        return dict(rec, errors=errors)
    errors.update({f"rank{r}": x["error"] for r, x in enumerate(results) if x and "error" in x})
    if errors:
        return dict(rec, errors=errors)
    ms = [x["ms"] for x in results]
    bw = opts["copy_bw"][:tp]
    nbytes = results[0]["bytes"]
    return dict(rec, ms=max(ms), ms_per_rank=ms, kv_bytes_per_gpu=nbytes,
                bw_fraction=nbytes / (max(ms) * 1e-3) / min(bw), copy_bandwidth_per_gpu=bw,
                rel_error=max(x["rel_error"] for x in results), config=infos[0]["configs"][pick],
                tune_s=max(i["tune_s"] for i in infos),
                tuning={json.dumps(c, sort_keys=True): [i["times"][k] for i in infos]
                        for k, c in enumerate(infos[0]["configs"])})


def _scaling_worker(rank: int, world: int, opts: dict) -> None:
    import torch.distributed as dist

    dev = setup_rank(rank, world, opts)
    try:
        shape = QUICK_SHAPE if opts["quick"] else SHAPE
        barrier(opts, rank)
        opts = dict(opts, copy_bw=gather(_copy_bandwidth(dev)))  # every GPU at once: what each gets alone
        doc = None
        if rank == 0:
            doc = dict(run_header(opts, world), shape=shape, copy_bandwidth_per_gpu=opts["copy_bw"],
                       method="per rank: Hq/tp, Hkv/tp heads, the whole batch; tuned over a short candidate list "
                              "(lowest time on the slowest rank), then all ranks time together after a barrier "
                              "(median of do_bench each); ms = the slowest rank; bw_fraction = KV bytes per GPU / ms "
                              "/ the lowest copy bandwidth of the GPUs used",
                       records=[])
            write_json(opts["scaling_file"], doc)
        tps = [t for t in (1, 2, 4, 8) if t <= world and shape["Hkv"] % t == 0]
        if world not in tps:
            tps.append(world)
        for name in opts["schemes"]:
            for tp in tps:
                rec = _scaling_point(name, tp, rank, dev, shape, opts)
                if rank == 0:
                    base = next((r for r in doc["records"] if r["scheme"] == name and r["tp"] == 1 and "ms" in r), None)
                    if tp == 1 and "ms" in rec:
                        rec["speedup_vs_tp1"] = 1.0
                    elif base and "ms" in rec:
                        rec["speedup_vs_tp1"] = base["ms"] / rec["ms"]
                    doc["records"].append(rec)
                    write_json(opts["scaling_file"], doc)
                    print(json.dumps({k: v for k, v in rec.items() if k not in ("tuning", "copy_bandwidth_per_gpu")},
                                     default=str), flush=True)
        barrier(opts, rank)
    finally:
        dist.destroy_process_group()


def scaling_table(doc: dict) -> str:
    bws = doc.get("copy_bandwidth_per_gpu") or []
    shape = doc.get("shape") or {}
    head = [f"{doc.get('gpu')} x{doc.get('gpus')}, torch {doc.get('torch')}, triton {doc.get('triton')}, {doc.get('date')}",
            f"decode B={shape.get('B')} L={shape.get('L')} (same total batch for every tp), {shape.get('Hq')}/{shape.get('Hkv')} "
            f"heads, D={shape.get('D')}, page 16; copy bandwidth per GPU "
            + ", ".join(f"{b / 1e12:.3f} TB/s" if b else "-" for b in bws)]
    if doc.get("note"):
        head.append(doc["note"])
    lines = head + [f"{'scheme':6} {'tp':>3} {'heads/GPU':>9} {'ms':>9} {'ms per rank':>24} {'KV MB/GPU':>10} "
                    f"{'bw/GPU':>7} {'speedup':>8} {'err':>8}  config"]
    for r in doc.get("records", []):
        heads = f"{r['q_heads_per_gpu']}/{r['kv_heads_per_gpu']}"
        if "ms" not in r:
            lines.append(f"{r['scheme']:6} {r['tp']:>3} {heads:>9} ERROR {json.dumps(r.get('errors'))[:200]}")
            continue
        per = ",".join(f"{m:.4f}" for m in r["ms_per_rank"])
        sp = r.get("speedup_vs_tp1")
        c = r["config"]
        lines.append(f"{r['scheme']:6} {r['tp']:>3} {heads:>9} {r['ms']:>9.4f} {per:>24} {r['kv_bytes_per_gpu'] / 1e6:>10.1f} "
                     f"{r['bw_fraction']:>7.3f} {(f'{sp:.2f}x' if sp else '-'):>8} {r['rel_error']:>8.4f}  "
                     f"splits {c.get('num_splits')} ppt {c.get('pages_per_tile')} w{c.get('num_warps')} s{c.get('num_stages')}")
    if doc.get("error"):
        lines.append(f"part failed: {doc['error']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _finish(path: Path, error: str | None, header: dict) -> dict:
    doc = json.loads(path.read_text()) if path.exists() else dict(header, records=[])
    if error:
        doc["error"] = error
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default benchmarks/results/<date>-<gpu>-x<N>/")
    ap.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU; 2 on the CPU)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default nccl on cuda, gloo on cpu")
    ap.add_argument("--model-dir", default=None, help="stories260K (default tests/assets/models/stories260K)")
    ap.add_argument("--parts", default="equivalence,scaling")
    ap.add_argument("--schemes", default=None, help="decode scaling schemes (default bf16,int8,int4; "
                                                    "fp32,int8,int4 on the CPU, whose interpreter mishandles bf16 pages)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="small decode shape (B=2, L=64), two candidates; "
                                                         "implied by --device cpu")
    ap.add_argument("--equivalence-timeout", type=float, default=240.0, help="seconds before part a is stopped")
    ap.add_argument("--scaling-timeout", type=float, default=270.0, help="seconds before part b is stopped")
    args = ap.parse_args(argv)

    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        n_visible = torch.cuda.device_count()
        world = args.gpus if args.gpus is not None else n_visible
        if n_visible < 2 or world < 2 or world > n_visible:
            print(f"tp_scaling needs N >= 2 CUDA GPUs (asked for {world}, {n_visible} visible); for a CPU smoke run: "
                  "TRITON_INTERPRET=1 python -m benchmarks.tp_scaling --backend gloo --device cpu --gpus 2", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name(0)
    else:
        world = args.gpus if args.gpus is not None else 2
        if world < 2:
            print("tp_scaling needs --gpus N >= 2", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned ranks
        gpu = "cpu"
    if backend == "nccl" and args.device != "cuda":
        print("NCCL needs --device cuda", file=sys.stderr)
        return 2
    if 8 % world:
        print(f"{world} ranks do not divide the 8 KV heads of the Llama-3-70B shape; use 2, 4 or 8", file=sys.stderr)
        return 2
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    quick = args.quick or args.device == "cpu"
    model_dir = args.model_dir or str(next((p for p in MODEL_DIRS if p.exists()), MODEL_DIRS[0]))
    schemes = (args.schemes or ("fp32,int8,int4" if args.device == "cpu" else "bf16,int8,int4")).split(",")
    date = dt.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"{date}-{slug}-x{world}"
    out.mkdir(parents=True, exist_ok=True)
    opts = dict(device=args.device, backend=backend, model_dir=model_dir, new_tokens=args.new_tokens, quick=quick,
                schemes=schemes, pg_timeout=300,
                command="python -m benchmarks.tp_scaling " + " ".join(argv if argv is not None else sys.argv[1:]),
                equivalence_file=str(out / "equivalence.json"), scaling_file=str(out / "tp_scaling.json"))
    header = dict(gpu=gpu, gpus=world, torch=torch.__version__, date=date, backend=backend, device=args.device,
                  command=opts["command"])
    parts = args.parts.split(",")
    print(f"tp_scaling: {world} ranks, {backend} on {args.device} ({gpu}); results in {out}", flush=True)
    if args.device == "cpu":
        print(CPU_NOTE, flush=True)

    def run_part(worker, json_name, timeout, title, table):
        # one part's ranks; a failure is recorded in its JSON and the other part still runs
        t0 = time.perf_counter()
        (out / json_name).unlink(missing_ok=True)
        try:
            error = spawn(worker, world, opts, timeout)
        except Exception as exc:
            error = error_text(exc)
        doc = _finish(out / json_name, error, header)
        print(f"\n{title} ({time.perf_counter() - t0:.0f} s):\n{table(doc)}", flush=True)

    if "equivalence" in parts:
        run_part(equivalence_worker, "equivalence.json", args.equivalence_timeout,
                 f"equivalence, tp=1 vs tp={world}", equivalence_table)
    if "scaling" in parts:
        run_part(_scaling_worker, "tp_scaling.json", args.scaling_timeout, "decode scaling", scaling_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
