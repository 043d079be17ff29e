"""What a prompt's chunk steps cost beside decode rows (GPU): the KV-bound case's prefill phase, taken apart.

    python -m benchmarks.experiments.mixed_step [--cases bf16:3,int4:11] [--context 34000] [--prompt 32768]

For each ``kv:rows`` case, in one process: an engine of the random-weight
Llama-3-8B shape (``benchmarks.engine``) with ``rows`` sequences prefilled to
``--context`` tokens (the KV-bound case's 16 GiB holds 4 bf16 or 12 int4
sequences of 32K+: the chunk steps of one prompt run beside 3 or 11 decode
rows), then:

- ``decode_ms``: a pure decode step of the rows (median of 5);
- ``chunk_ms``: each step of a new ``--prompt``-token prompt until its last
  chunk, the rows decoding beside it;
- ``alone_ms``: the same prompt length alone in an engine of one sequence,
  its whole prefill (``benchmarks.engine``'s TTFT: the median of three
  prompts after a warm-up prompt of that length).

``extra_ms = sum(chunk_ms) - len(chunk_ms) * decode_ms - alone_ms`` is what
mixing costs beyond running the two apart. Prints one JSON object per case.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from benchmarks import engine as bench


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def case(kv: str, rows: int, context: int, prompt: int) -> dict:
    from kvgen.engine import SamplingParams

    alone = bench.ttft_record(kv, prompt)["ms"]
    # the rows, prefilled up to their last token, with room for one more sequence
    eng = bench.filled_engine(kv, rows, context, context + 2048, max_num_seqs=rows + 1)
    for _ in range(3):
        eng.step()
    decode = statistics.median(bench.timed_steps(eng, 1) for _ in range(5))
    eng.add_request("new", _prompt(9, prompt), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    chunks: list[float] = []
    while len(chunks) <= 64:  # until the prompt's last chunk ran (its first token sampled)
        chunks.append(bench.timed_steps(eng, 1))
        new = next((s for s in eng.scheduler.running if s.request.request_id == "new"), None)
        if new is not None and new.num_computed >= len(new.tokens) - 1:
            break
    rec = dict(kv=kv, rows=rows, context=context, prompt=prompt, alone_ms=alone, decode_ms=decode, chunk_ms=chunks,
               extra_ms=sum(chunks) - len(chunks) * decode - alone, running=len(eng.scheduler.running))
    print(json.dumps(rec), flush=True)
    holder = [eng]
    del eng
    bench.release(holder)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="bf16:3,int4:11")
    ap.add_argument("--context", type=int, default=34000)
    ap.add_argument("--prompt", type=int, default=32768)
    args = ap.parse_args()
    for item in args.cases.split(","):
        kv, rows = item.split(":")
        case(kv, int(rows), args.context, args.prompt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
