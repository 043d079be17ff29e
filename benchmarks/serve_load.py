"""kvgen serve under load: requests/s, TTFT and TPOT at 1/16/64/256 clients, served vs the engine offline.

    python -m benchmarks.serve_load [--quick] [--kv bf16,int8,int4] [--out benchmarks/results/serve_load.json]
    python -m benchmarks.serve_load --standin [--step-ms 10]   # CPU proxy of the HTTP overhead (no GPU)
    python -m benchmarks.serve_load --smoke        # CPU, tiny random model, interpreter: checks the script runs
    python -m benchmarks.serve_load --engine-in-process ...    # the engine on a thread of the server instead
    python -m benchmarks.serve_load --plot a.json [b.json ...] --png out.png   # table and plot of saved results

GPU: a Llama-3-8B-shaped model with random bf16 weights (benchmarks.engine's
config; no download, no tokenizer: prompts are token ids), one engine per KV
scheme. ``--standin``: the same engine machinery (scheduler, sampler, a real
KVCache and BlockManager of a tiny model) with a stand-in model whose step
sleeps ``--step-ms`` (releasing the GIL as a wait on the GPU does) and reads
the next token from a table -- so on a CPU the served run pays exactly the
server's own costs (HTTP, SSE, JSON, the hand-over between the server and
the engine process; with ``--engine-in-process`` the GIL shared with the
engine thread). It assumes spare cores, as on a GPU host: on a machine
where the client process, the server and the engine process share fewer
cores than they keep busy, the engine process waits for a core at every
step (on a 2-core VM the kernel ran the woken server before letting the
engine process's send return: 3 ms per 12 ms step at 64 clients).

Per KV scheme one server runs, as ``kvgen serve`` runs it: ``kvgen
serve``'s app on 127.0.0.1 (uvicorn in this process) with the engine built
and run in its own process (:class:`kvgen.serve.engine_process.EngineSpec`
of :func:`bench_engine`), so GPU memory holds one engine at a time and this
process never touches the GPU. With ``--engine-in-process`` the engine is
built here and runs on a thread of the server (``kvgen serve
--engine-in-process``). For each concurrency C a bounded, seeded workload of
requests (prompt and output lengths uniform, ``ignore_eos``) runs on both
paths on that same engine, after a warm-up of each path at C (kernel
tuning, graph capture, connection set-up are paid before anything is timed);
every timed run has its own prompt ids (same lengths), so no run finds
another's prompts in the prefix cache:

- ``offline``: straight on the engine, where it runs (the server's
  ``call(offline_run, ...)`` runs it between two steps of the idle server),
  closed loop with at most C requests in flight (a finished request is
  replaced by the next), as the clients do;
- ``served``: through the server, driven by C streaming HTTP clients in a
  separate process (so the load generator does not share the server's
  GIL), ``stream_options.include_usage`` on.

Records (JSON ``{machine, python, torch, triton, date, command, engine, records}``; ``engine``: where it ran):
``kind`` ``served`` or ``offline``, ``kv``, ``clients``, ``requests``, ``s``,
``requests_per_s``, ``tokens_per_s`` (output tokens), ``ttft_p50/p99_ms``,
``tpot_p50/p99_ms`` (served: client-side, first streamed token after sending,
(last - first token) / (tokens - 1); offline: the engine's request times) and,
for ``served``, ``http_overhead`` = 1 - served tokens/s / offline tokens/s at
the same C; ``failed``: requests that got an HTTP or connection error (counted, not retried; up to three
``failures`` quoted), ``listen_overflows``: connections the kernel dropped from a full accept queue during the
run (Linux, system-wide). Each client process opens its connections before the timed start.
With ``--repeat R`` each path runs R times (alternating, the first path of
each repeat alternating too) and the fastest run of each is kept (``runs``
lists all tokens/s); ``tokens_per_s_median`` and ``http_overhead_median`` are
the same from the median run of each path; ``http_overhead_paired`` is the
median over repeats of each repeat's own overhead; ``tuned_in_runs``: per run,
the shape buckets the engine's autotuner timed during it (a cold tuning cache
makes those runs slow).
The offline path runs the engine as ``LLM.generate`` does (``output_kind``
``final``, no running text), the served path as ``kvgen serve`` does (deltas).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvgen.atomic import write_atomic
from kvgen.engine.config import DEFAULT_ENGINE_BACKEND  # the backend the engines here are asked for (recorded)

from benchmarks.serve_load_clients import CLIENTS_PER_PROCESS, MODEL
from benchmarks.serve_load_report import plot, plot_main, table

CONCURRENCY = (1, 16, 64, 256)
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True, torch_dtype="float32")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, run: int = 0) -> list:
    """``n`` requests ``(prompt ids, max_tokens)``: lengths from ``seed``, the ids from ``seed`` and ``run``.

    Each timed run draws its own ids (same lengths): a run repeating an earlier run's prompts would find them in
    the prefix cache and skip their prefill (the first benchmark runs measured exactly that).
    """
    sizes = random.Random(seed)
    lengths = [(sizes.randint(*prompt), sizes.randint(*output)) for _ in range(n)]
    ids = random.Random(f"{seed}/{run}")
    return [([ids.randrange(10, vocab) for _ in range(k)], m) for k, m in lengths]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summary(n: int, s: float, tokens: int, ttft_s: list[float], tpot_s: list[float]) -> dict:
    ttft = [x * 1e3 for x in ttft_s]
    tpot = [x * 1e3 for x in tpot_s]
    return dict(requests=n, s=s, requests_per_s=n / s, tokens_per_s=tokens / s, ttft_p50_ms=percentile(ttft, 50),
                ttft_p99_ms=percentile(ttft, 99), tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99))


class StandinRunner:
    """A model step that costs ``step_s`` of waiting (``time.sleep``: the GIL is free, as during a GPU wait).

    Logits of a row = ``table[last input token]`` (a fixed random table), so
    the engine's sampler, scheduler and KV cache do their real work.
    """

    def __init__(self, step_s: float, vocab: int, seed: int = 0) -> None:
        import torch

        self.step_s = step_s
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 3

    def run(self, step, input_ids, positions, sample_rows):
        import torch

        time.sleep(self.step_s)
        if not sample_rows:
            return None
        return self.table.index_select(0, torch.tensor([input_ids[r] for r in sample_rows]))


# -- the engine side (in the engine process, or on the server's engine thread) -------------------------------------
def bench_engine(*, kv: str, cpu: bool, standin: bool, step_ms: float, smoke: bool, max_num_seqs: int):
    """The benchmark's engine for one KV scheme (module-level: the engine process builds it from an EngineSpec)."""
    from kvgen.engine.loader import build_engine

    if cpu:
        config, dev, dtype = TINY, "cpu", "float32"
        max_model_len = 64 if smoke else 256
        max_tokens = max_model_len * max_num_seqs
    else:
        from benchmarks.engine import LLAMA3_8B
        config, dev, dtype, max_model_len, max_tokens = LLAMA3_8B, "cuda", "bfloat16", 2048, None
    engine = build_engine(config=config, kv=kv, dtype=dtype, device=dev, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_tokens=max_tokens,
                          max_num_batched_tokens=4096 if standin else None, verbose=not standin)
    if standin:
        engine.runner = StandinRunner(step_ms / 1e3, config["vocab_size"])
    return engine


def device_name(engine) -> str | None:
    """The engine's GPU name (None on the CPU); read where the engine runs, so this process never touches CUDA."""
    import torch

    dev = engine.cache.device
    return torch.cuda.get_device_name(dev) if torch.device(dev).type == "cuda" else None


def tuned_buckets(engine) -> int:
    """How many shape buckets the engine's kernel autotuner has timed so far (tuning inside a timed run is
    time the run pays: a cold tuning cache on a fresh machine shows up as a slow run)."""
    tuner = getattr(getattr(engine, "cache", None), "autotuner", None)
    return len(getattr(tuner, "tuned", ()))


def offline_run(engine, reqs: list, clients: int) -> dict:
    """:func:`offline` with the engine's device sync; run on the engine between two steps of an idle server."""
    import torch

    dev = torch.device(engine.cache.device)
    return offline(engine, reqs, clients, torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))


def offline(engine, reqs: list, clients: int, sync) -> dict:
    """The workload straight on the engine, at most ``clients`` requests in flight."""
    # As LLM.generate runs the engine: outputs only when a request finishes, no running text. The served path's
    # app sets the same engine to deltas with text; both are put back afterwards.
    saved = engine.output_kind, engine.stream_text
    engine.output_kind, engine.stream_text = "final", False
    try:
        return _offline(engine, reqs, clients, sync)
    finally:
        engine.output_kind, engine.stream_text = saved


def _offline(engine, reqs: list, clients: int, sync) -> dict:
    from kvgen.engine import SamplingParams

    pending = list(reversed(reqs))
    live = 0
    generated = 0
    ttft: list[float] = []
    tpot: list[float] = []
    sync()
    t = time.perf_counter()
    while pending or live:
        while pending and live < clients:
            prompt, n = pending.pop()
            engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            live += 1
        for out in engine.step():
            if out.finished:
                live -= 1
                k = len(out.outputs[0].token_ids)
                generated += k
                m = out.metrics
                ttft.append(m.first_token_time - m.arrival_time)
                if k > 1:
                    tpot.append((m.finished_time - m.first_token_time) / (k - 1))
    sync()
    s = time.perf_counter() - t
    return summary(len(reqs), s, generated, ttft, tpot)


class Served:
    """``kvgen serve``'s app for ``engine`` (an EngineSpec, or an engine) on a free loopback port, in a thread."""

    def __init__(self, engine) -> None:
        from kvgen.serve.app import build_app
        from kvgen.serve.server import bind, make_server

        self.app = build_app(engine, model_name=MODEL, max_pending=4096)
        self.worker = self.app.state.serve.worker
        self.server = make_server(self.app, drain_timeout=5)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def call(self, fn, *args):
        """``fn(engine, *args)`` where the engine runs, between two steps; its result."""
        return asyncio.run_coroutine_threadsafe(self.worker.call(fn, *args), self.worker.loop).result()

    def stop(self) -> None:
        self.server.request_exit()
        self.thread.join(60)


def drive(url: str, reqs: list, clients: int) -> dict:
    """``reqs`` through the server from ``ceil(clients / CLIENTS_PER_PROCESS)`` client processes (outside this
    process: the load generator must not share the server's GIL); one summary over all of them.

    The processes split the clients and, round-robin, the requests; once every one has opened its
    connections they start together at one ``time.monotonic`` instant, and the run lasts from the first start
    to the last finish.
    """
    procs = max(1, -(-clients // CLIENTS_PER_PROCESS))
    running, files, errs = [], [], []
    try:
        for i in range(procs):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(reqs[i::procs], f)
            files.append(f.name)
            # stderr to a file, read at the end: a pipe nobody drains could stall a chatty client mid-run
            errs.append(tempfile.TemporaryFile("w+"))
            cmd = [sys.executable, "-m", "benchmarks.serve_load_clients", "--url", url, "--workload", f.name,
                   "--concurrency", str(clients // procs + (i < clients % procs))]
            running.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[-1],
                                            text=True, cwd=Path(__file__).resolve().parents[1]))

        def stderr_of(i: int) -> str:
            errs[i].seek(0)
            return errs[i].read()[-2000:]

        for i, p in enumerate(running):
            if _readline(p.stdout, READY_TIMEOUT_S).strip() != "ready":
                raise RuntimeError(f"client {i} was not ready within {READY_TIMEOUT_S:g} s: {stderr_of(i)}")
        overflows = listen_overflows()  # from here: the timed run (every connection is open)
        start_at = time.monotonic() + 0.05
        for p in running:
            p.stdin.write(f"{start_at!r}\n")
            p.stdin.flush()
        results = []
        for i, p in enumerate(running):
            out, _ = p.communicate(timeout=3600)
            if p.returncode:
                raise RuntimeError(f"client {i} failed: {stderr_of(i)}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
        for f in errs:
            f.close()
        for name in files:
            Path(name).unlink(missing_ok=True)
    stats = [x for r in results for x in r["stats"]]
    failures = [x for r in results for x in r["failures"]]
    s = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    if failures:
        log(f"x{clients}: {len(failures)} of {len(reqs)} requests failed, first: {failures[0]}")
    if not stats:
        raise RuntimeError(f"every request failed, first: {failures[0]}")
    rec = summary(len(stats), s, sum(x[2] for x in stats), [x[0] for x in stats],
                  [x[1] for x in stats if x[1] is not None])
    rec.update(failed=len(failures), failures=failures[:3])
    if overflows is not None:
        rec["listen_overflows"] = listen_overflows() - overflows
    return rec


READY_TIMEOUT_S = 60.0
"""A client process must have imported httpx and opened its connections within this time."""


def _readline(stream, timeout: float) -> str:
    """One line of a pipe, or "" after ``timeout`` seconds (a thread waits on it: pipes have no timeouts)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return None


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because an accept queue was full (Linux; None elsewhere).

    System-wide: the difference over a run counts any listener of the machine (here, in practice, the server)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:]))
            return int(table.get("ListenOverflows", 0))
    return None


def measure(served: Served, reqs_of, warm_of, clients: int, repeat: int) -> tuple[dict, dict]:
    """Both paths at ``clients``, each warmed up first; the fastest of ``repeat`` runs each.

    ``reqs_of(k)``: the workload of the k-th timed run, ``warm_of(k)`` of the k-th warm-up (same lengths per
    kind, fresh prompt ids: no run or warm-up finds another's prompts in the prefix cache, so both paths'
    warm-ups prefill for real). Repeats alternate which path runs first (offline, served; served, offline;
    ...), so a drift over the level (the prefix cache filling up) does not fall on one path; the served
    record's ``http_overhead_paired`` is the median over the repeats of 1 - served / offline of the same
    repeat.
    """
    served.call(offline_run, warm_of(0), clients)
    drive(served.url, warm_of(1), clients)
    runs: dict[str, list[dict]] = {"offline": [], "served": []}
    for r in range(repeat):
        order = ("offline", "served") if r % 2 == 0 else ("served", "offline")
        for i, kind in enumerate(order):
            reqs = reqs_of(2 * r + i)
            before = served.call(tuned_buckets)
            run = served.call(offline_run, reqs, clients) if kind == "offline" else drive(served.url, reqs, clients)
            run["tuned_buckets"] = served.call(tuned_buckets) - before
            if run["tuned_buckets"]:
                log(f"x{clients} {kind} run {r}: the autotuner timed {run['tuned_buckets']} new shape buckets "
                    f"during it (its time is in the run)")
            runs[kind].append(run)
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
    for k, v in runs.items():
        best[k] = dict(best[k], runs=[round(r["tokens_per_s"], 1) for r in v],
                       tuned_in_runs=[r["tuned_buckets"] for r in v],
                       tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in v))
    best["served"]["http_overhead_paired"] = statistics.median(
        1 - s["tokens_per_s"] / o["tokens_per_s"] for o, s in zip(runs["offline"], runs["served"]))
    return best["offline"], best["served"]


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests (minutes)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 1 and 4 clients (checks the script)")
    ap.add_argument("--standin", action="store_true",
                    help="CPU proxy: a stand-in model whose step sleeps --step-ms (no GPU, no kernels)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="--standin: the stand-in model's step time")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each path per C; the fastest is kept")
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    ap.add_argument("--kv", default="bf16,int8,int4")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="client counts, comma-separated")
    ap.add_argument("--engine-in-process", action="store_true",
                    help="build the engine here and serve it from a thread (kvgen serve --engine-in-process); "
                         "default: the engine in its own process, as kvgen serve runs it")
    ap.add_argument("--plot", nargs="+", metavar="JSON",
                    help="no run: print the table of these result files and plot it to --png")
    ap.add_argument("--png", default="benchmarks/results/serve_load.png", help="where --plot writes (and a run)")
    args = ap.parse_args(argv)
    if args.plot:
        return plot_main(args.plot, args.png)
    cpu = args.smoke or args.standin
    if cpu:  # the KV cache's kernels run in the interpreter on the CPU (the stand-in launches none per step)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; the engine process inherits it

    import torch
    import triton

    import kvgen.serve.app  # noqa: F401 -- fail now, not after the first engine, without the serve extra
    from kvgen.serve.engine_process import EngineSpec

    smoke, quick = args.smoke, args.quick or args.smoke
    levels = [1, 4] if smoke else [int(c) for c in args.concurrency.split(",")]
    kvs = ["fp32"] if cpu else args.kv.split(",")
    if cpu:
        vocab = TINY["vocab_size"]
        prompt, output = ((8, 24), (3, 5)) if smoke else ((16, 64), (32, 96))
    else:
        vocab = 100000
        prompt, output = ((128, 512), (32, 128)) if quick else ((256, 1024), (64, 256))
    records: list[dict] = []
    doc = dict(machine=machine(), python=platform.python_version(), torch=torch.__version__,
               triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(), quick=quick,
               command="python -m benchmarks.serve_load " + " ".join(sys.argv[1:] if argv is None else argv),
               model=("stand-in (sleep %g ms per step, table tokens) on a tiny fp32 KVCache" % args.step_ms
                      if args.standin else "tiny random" if smoke else "Llama-3-8B shape, random weights"),
               engine="server's process (thread)" if args.engine_in_process else "own process",
               somaxconn=_read_int("/proc/sys/net/core/somaxconn"), kernel_backend=DEFAULT_ENGINE_BACKEND,
               prompt_tokens=list(prompt), output_tokens=list(output), records=records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_atomic(out, json.dumps(doc, indent=1))

    for kv in kvs:
        spec = EngineSpec(bench_engine, dict(kv=kv, cpu=cpu, standin=args.standin, step_ms=args.step_ms,
                                             smoke=smoke, max_num_seqs=max(levels)))
        try:
            served = Served(spec.build() if args.engine_in_process else spec)
        except Exception as e:  # one scheme failing must not lose the others
            log(f"{kv}: engine failed: {type(e).__name__}: {e}")
            continue
        try:
            doc["machine"] = served.call(device_name) or doc["machine"]
            for c in levels:
                if smoke:
                    n = 2 * c
                elif quick:
                    n = min(max(4 * c, 8), 1024)
                else:
                    n = min(max(4 * c, 32), 1024)
                def reqs_of(run: int, n=n, c=c) -> list:
                    return workload(n, seed=c, prompt=prompt, output=output, vocab=vocab, run=run)

                def warm_of(run: int, n=min(n, max(c, 4)), c=c) -> list:
                    return workload(n, seed=10_000 + c, prompt=prompt, output=output, vocab=vocab, run=run)

                try:
                    base, rec = measure(served, reqs_of, warm_of, c, max(1, args.repeat))
                except Exception as e:
                    log(f"{kv} x{c}: run failed: {e}")
                    continue
                base.update(kind="offline", kv=kv, clients=c)
                rec.update(kind="served", kv=kv, clients=c,
                           http_overhead=1 - rec["tokens_per_s"] / base["tokens_per_s"],
                           http_overhead_median=1 - rec["tokens_per_s_median"] / base["tokens_per_s_median"])
                records += [base, rec]
                log(json.dumps(base))
                log(json.dumps(rec))
                save()
        finally:
            served.stop()  # the engine process exits: its GPU memory is free for the next scheme's engine
        if args.engine_in_process:
            engine = served.worker.engine
            engine.close()
            del engine, served
            # the engine's tensors sit in reference cycles (graphs, runner, cache): collect them before the next
            # scheme's engine sizes its KV from free memory (H200: int8 and int4 hit OOM after bf16 without this)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save()
    log(f"wrote {out}")
    log(table(records))
    if records and plot(records, Path(args.png)):
        log(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
