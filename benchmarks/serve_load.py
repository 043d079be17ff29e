"""kvgen serve under load (GPU): requests/s, TTFT and TPOT at 1/16/64/256 clients, vs the engine offline.

    python -m benchmarks.serve_load [--quick] [--kv bf16,int8,int4] [--out benchmarks/results/serve_load.json]
    python -m benchmarks.serve_load --smoke        # CPU, tiny random model, interpreter: checks the script runs

A Llama-3-8B-shaped model with random bf16 weights (benchmarks.engine's
config; no download, no tokenizer: prompts are token ids). Per KV scheme
one engine is built; for each concurrency C a bounded, seeded workload of
requests (prompt and output lengths uniform) runs twice:

- ``served`` (first): through ``kvgen serve`` on 127.0.0.1 (uvicorn and the engine
  thread in this process, as ``kvgen serve`` runs them), driven by C
  streaming HTTP clients in a separate process (so the load generator does
  not share the server's GIL), ``stream_options.include_usage`` on;
- ``offline`` (second, so it gets any kernel tuning the first run paid
  for): straight on the engine, closed loop with at most C requests in
  flight (a finished request is replaced by the next), as the clients do.

Records (JSON ``{gpu, torch, triton, date, quick, records}``): ``kind``
``served`` or ``offline``, ``kv``, ``clients``, ``requests``, ``s``,
``requests_per_s``, ``tokens_per_s`` (output tokens), and for ``served``
``ttft_p50/p99_ms``, ``tpot_p50/p99_ms`` (client-side: first streamed token
after sending; (last - first token) / (tokens - 1)) and ``http_overhead``
= 1 - served tokens/s / offline tokens/s at the same C.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONCURRENCY = (1, 16, 64, 256)
MODEL = "llama-3-8b-random"
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True, torch_dtype="float32")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int) -> list:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# -- the client process -------------------------------------------------------------------------------------------
async def _client_run(url: str, reqs: list, clients: int) -> dict:
    import httpx

    queue = list(enumerate(reqs))
    stats: list[dict] = []

    async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk.get("choices"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
        stats.append(dict(ttft=first - t0, tpot=(last - first) / (tokens - 1) if tokens > 1 else None,
                          tokens=tokens))

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            _, (prompt, n) = queue.pop(0)
            await one(http, prompt, n)

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
        t = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(clients)))
        s = time.perf_counter() - t
    ttft = [x["ttft"] * 1e3 for x in stats]
    tpot = [x["tpot"] * 1e3 for x in stats if x["tpot"] is not None]
    return dict(requests=len(stats), s=s, requests_per_s=len(stats) / s,
                tokens_per_s=sum(x["tokens"] for x in stats) / s, ttft_p50_ms=percentile(ttft, 50),
                ttft_p99_ms=percentile(ttft, 99), tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99))


def client_main(args: argparse.Namespace) -> int:
    reqs = json.loads(Path(args.workload).read_text())
    print(json.dumps(asyncio.run(_client_run(args.url, reqs, int(args.concurrency)))))
    return 0


# -- the server side ----------------------------------------------------------------------------------------------
def offline(engine, reqs: list, clients: int, sync) -> dict:
    """The workload straight on the engine, at most ``clients`` requests in flight."""
    from kvgen.engine import SamplingParams

    engine.stream_text = False
    pending = list(reqs)
    live = 0
    generated = 0
    sync()
    t = time.perf_counter()
    while pending or live:
        while pending and live < clients:
            prompt, n = pending.pop(0)
            engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            live += 1
        for out in engine.step():
            if out.finished:
                live -= 1
                generated += len(out.outputs[0].token_ids)
    sync()
    s = time.perf_counter() - t
    engine.stream_text = True
    return dict(requests=len(reqs), s=s, requests_per_s=len(reqs) / s, tokens_per_s=generated / s)


class Served:
    """``kvgen serve``'s app for ``engine`` on a free loopback port, in a thread of this process."""

    def __init__(self, engine) -> None:
        from kvgen.serve.app import build_app
        from kvgen.serve.server import bind, make_server

        self.app = build_app(engine, model_name=MODEL, max_pending=4096)
        self.server = make_server(self.app, drain_timeout=5)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.request_exit()
        self.thread.join(60)


def drive(url: str, reqs: list, clients: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reqs, f)
    cmd = [sys.executable, "-m", "benchmarks.serve_load", "--client", "--url", url, "--workload", f.name,
           "--concurrency", str(clients)]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"client failed: {e.stderr[-2000:]}") from None
    finally:
        Path(f.name).unlink(missing_ok=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests (minutes)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 1 and 4 clients (checks the script)")
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    ap.add_argument("--kv", default="bf16,int8,int4")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="client counts, comma-separated")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)

    import torch
    import triton

    import kvgen.serve.app  # noqa: F401 -- fail now, not after the first engine, without the serve extra
    from kvgen.engine.loader import build_engine

    smoke, quick = args.smoke, args.quick or args.smoke
    levels = [1, 4] if smoke else [int(c) for c in args.concurrency.split(",")]
    kvs = ["fp32"] if smoke else args.kv.split(",")
    if smoke:
        config, dev, dtype, vocab = TINY, "cpu", "float32", TINY["vocab_size"]
        prompt, output = (8, 24), (3, 5)
    else:
        from benchmarks.engine import LLAMA3_8B
        config, dev, dtype, vocab = LLAMA3_8B, "cuda", "bfloat16", 100000
        prompt, output = ((128, 512), (32, 128)) if quick else ((256, 1024), (64, 256))
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    records: list[dict] = []
    doc = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               quick=quick, model="Llama-3-8B shape, random weights" if not smoke else "tiny random",
               prompt_tokens=list(prompt), output_tokens=list(output), records=records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)

    for kv in kvs:
        try:
            engine = build_engine(config=config, kv=kv, dtype=dtype, device=dev, max_model_len=2048 if not smoke
                                  else 64, max_num_seqs=max(levels), max_tokens=None if not smoke else 4096)
        except Exception as e:  # one scheme failing must not lose the others
            log(f"{kv}: engine failed: {type(e).__name__}: {e}")
            continue
        for c in levels:
            n = (max(2 * c, 8) if quick else min(max(4 * c, 32), 1024)) if not smoke else 2 * c
            reqs = workload(n, seed=c, prompt=prompt, output=output, vocab=vocab)
            server = Served(engine)
            try:
                drive(server.url, reqs[:1], 1)  # warm-up: connection set-up, first request path
                rec = drive(server.url, reqs, c)
            except Exception as e:
                log(f"{kv} x{c}: served run failed: {e}")
                continue
            finally:
                server.stop()
            # offline second: it inherits the kernels tuned during the served run, so the overhead is not flattered
            base = offline(engine, reqs, c, sync)
            base.update(kind="offline", kv=kv, clients=c)
            records.append(base)
            log(json.dumps(base))
            rec.update(kind="served", kv=kv, clients=c,
                       http_overhead=1 - rec["tokens_per_s"] / base["tokens_per_s"])
            records.append(rec)
            log(json.dumps(rec))
            save()
        del engine
        if dev == "cuda":
            torch.cuda.empty_cache()
    save()
    log(f"wrote {out}")
    for r in records:
        if r["kind"] == "served":
            log(f"{r['kv']:>5} x{r['clients']:<4} {r['requests_per_s']:8.2f} req/s {r['tokens_per_s']:9.0f} tok/s  "
                f"TTFT p50/p99 {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} ms  TPOT p50/p99 "
                f"{r['tpot_p50_ms'] or 0:.1f}/{r['tpot_p99_ms'] or 0:.1f} ms  overhead {100 * r['http_overhead']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
