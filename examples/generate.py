#!/usr/bin/env python
"""Tell a story with stories260K on a kvgen int8 KV cache.

    python examples/generate.py [--scheme int8] [--max-new-tokens 64] [--prompt "Once upon a time"]

Loads the stories260K Llama that ships with the tests
(``tests/assets/models/stories260K``, see its README for the license), plans and compiles a kvgen KV cache for it
(``kvgen.integrations.transformers.attach``), and calls a plain
``model.generate``. Without a GPU the kernels run on the Triton CPU
interpreter (set here before anything imports triton): about half a second
per token for this tiny model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "tests" / "assets" / "models" / "stories260K"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="int8", help="kvgen KV scheme (fp32, fp16, int8, fp8, int4, int2)")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=MODEL)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels)
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvgen.integrations.transformers import attach

    if not args.model.exists():
        print(f"model folder {args.model} not found; pass --model PATH", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
    start = time.perf_counter()
    attach(model, scheme=args.scheme, max_tokens=4096)
    plan = model._kvgen["plan"]
    print(f"[kvgen] plan {plan.name}: scheme {plan.scheme}, page {plan.page_size}, "
          f"{plan.kv_bytes_per_token:,} KV bytes/token (attach {time.perf_counter() - start:.1f}s, {device})",
          file=sys.stderr)

    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=not args.greedy,
                             temperature=0.8, top_p=0.95, pad_token_id=tokenizer.unk_token_id)
    seconds = time.perf_counter() - start
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    new = out.shape[1] - ids.shape[1]
    print(f"[kvgen] {new} tokens in {seconds:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
