"""The load generator of :mod:`benchmarks.serve_load`: one process of up to :data:`CLIENTS_PER_PROCESS` streaming
OpenAI-completions clients, started by ``serve_load.drive`` (never by hand).

    python -m benchmarks.serve_load_clients --url URL --workload REQS.json --concurrency C

It opens its C connections, prints ``ready``, reads the start instant (``time.monotonic``) from stdin, runs the
workload's ``[prompt ids, max_tokens]`` requests with C workers and prints one JSON line: ``{"t0", "t1",
"stats": [[ttft_s, tpot_s or None, tokens], ...], "failures": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

MODEL = "llama-3-8b-random"
"""The model name the served engines answer to and the clients ask for."""
CLIENTS_PER_PROCESS = 64
"""Streaming clients one load-generator process drives at most: one Python process parsing the SSE streams of
256 clients became the bottleneck (the served path then measured the load generator, not the server)."""


async def _client_run(url: str, reqs: list, clients: int) -> dict:
    """Open ``clients`` connections, print ``ready``, read the start instant from stdin (``time.monotonic``, one
    clock for every process), and run ``reqs`` with ``clients`` workers from then.

    Returns ``{"t0", "t1", "stats": [[ttft_s, tpot_s or None, tokens], ...]}``.
    """
    import httpx

    queue = list(reversed(reqs))
    stats: list[tuple[float, float | None, int]] = []
    failures: list[str] = []

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
                if '"choices":[]' in line.replace(" ", ""):  # the usage chunk: only this one is parsed
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                else:  # a chunk with tokens (parsing each would make the client, not the server, the bottleneck)
                    last = time.perf_counter()
                    first = first or last
        if first is None or tokens < 1:
            raise RuntimeError(f"a request got no tokens (usage {tokens})")
        stats.append((first - t0, (last - first) / (tokens - 1) if tokens > 1 else None, tokens))

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            prompt, n = queue.pop()
            try:
                await one(http, prompt, n)
            except Exception as e:  # noqa: BLE001 -- counted and reported, as serving benchmarks do
                failures.append(f"{type(e).__name__}: {e}"[:200])

    async def connect(http: httpx.AsyncClient) -> None:
        for attempt in range(3):  # set-up only: a refused or reset connect here is retried, never timed
            try:
                (await http.get(url + "/health", timeout=30.0)).raise_for_status()
                return
            except httpx.HTTPError as e:
                error = e
                await asyncio.sleep(0.2 * (attempt + 1))
        raise RuntimeError(f"could not connect before the start: {type(error).__name__}: {error}")

    def user() -> httpx.AsyncClient:
        # One client (one connection) per simulated user, as independent users have: with one shared pool of C
        # connections httpcore's bookkeeping costs O(C) per request event, and at 64 clients the load generator
        # itself delayed the first requests by up to 0.5 s (measured as the server's time to first token).
        # TCP_NODELAY: httpx writes a request's headers and body separately; with Nagle on, the body waits for the
        # server's delayed ACK (~40 ms on Linux), which would be counted as the server's time to first token.
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                                             socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(600.0))

    users = [user() for _ in range(clients)]
    try:
        # Connect before the start: a burst of hundreds of connects at the timed start measured the kernel's
        # accept queue, not the server.
        await asyncio.gather(*(connect(http) for http in users))
        print("ready", flush=True)
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        t0 = time.monotonic()
        await asyncio.gather(*(worker(http) for http in users))
        t1 = time.monotonic()
    finally:
        await asyncio.gather(*(http.aclose() for http in users), return_exceptions=True)
    return {"t0": t0, "t1": t1, "stats": stats, "failures": failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--workload", required=True, help="a JSON list of [prompt token ids, max_tokens]")
    ap.add_argument("--concurrency", type=int, required=True)
    args = ap.parse_args(argv)
    reqs = json.loads(Path(args.workload).read_text())
    print(json.dumps(asyncio.run(_client_run(args.url, reqs, args.concurrency))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
