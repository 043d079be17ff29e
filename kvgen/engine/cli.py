"""``kvgen generate``: stream a completion of one prompt to stdout (imports torch only when run).

For kvgen/cli.py's COMMANDS table this module offers ``add_args(parser)``
and ``run(args) -> int``. A KvgenError
propagates (the CLI prints it as one line and exits 2).
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "generate text with a model on kvgen's KV cache (continuous-batching engine)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="Hugging Face model folder (config.json, safetensors, tokenizer) or a .gguf file")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--kv", default="int8", help="KV-cache scheme, e.g. bf16, int8, int4 (default int8)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the model's; fp32 on the CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit in tokens")
    p.add_argument("--cache-tokens", type=int, default=None, help="KV capacity in tokens (default: the plan's)")
    p.add_argument("--device", default=None, help="torch device (default: the GPU, else the CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: one process per GPU (0..N-1), or per rank on the CPU (default 1)")
    p.add_argument("--host-tokens", type=host_tokens_arg, default=None,
                   help="KV tokens in a host-memory tier ('plan': the plan's host tier); preempted sequences swap "
                        "there instead of being recomputed")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    add_speed_args(p)
    if not any(a.dest == "json" for a in p._actions):
        p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")


def add_speed_args(p: argparse.ArgumentParser) -> None:
    """The engine options of ``kvgen generate`` and ``kvgen serve`` that change speed, not results."""
    from kvgen.engine.config import DEFAULT_ENGINE_BACKEND, ENGINE_BACKENDS  # light: no torch

    p.add_argument("--async-scheduling", action="store_true",
                   help="plan each decode step while the device runs the one before (faster steps on a GPU; "
                        "not with --tp above 1 or --host-tokens)")
    p.add_argument("--backend", default=DEFAULT_ENGINE_BACKEND, choices=ENGINE_BACKENDS,
                   help="kernel language, as in 'kvgen compile': auto (default: both; the decode kernel that times "
                        "faster on this GPU runs, timed once at start and remembered; triton off a GPU or without "
                        "nvcc), triton, or cuda (the CUDA decode kernel where the scheme has one: faster "
                        "int8/fp8/int4/int2 KV on a GPU; needs nvcc once, to build it)")


def host_tokens_arg(text: str) -> int | str:
    """``--host-tokens``: a positive int, or ``plan``."""
    if text == "plan":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens or 'plan', got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from .config import DEFAULT_ENGINE_BACKEND
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(args.model, kv=args.kv, dtype=args.dtype, max_model_len=args.max_model_len,
              max_tokens=args.cache_tokens, device=args.device, enforce_eager=args.enforce_eager, max_num_seqs=1,
              tp=getattr(args, "tp", 1), host_tokens=getattr(args, "host_tokens", None),
              async_scheduling=getattr(args, "async_scheduling", False),
              kernel_backend=getattr(args, "backend", DEFAULT_ENGINE_BACKEND))
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        return _stream(llm, prompt, params, args)
    finally:
        llm.close()


def _stream(llm, prompt, params, args: argparse.Namespace) -> int:
    shown = ""
    last = None
    for out in llm.stream(prompt, params):
        last = out
        text = out.outputs[0].text
        if not getattr(args, "json", False) and text.startswith(shown) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    comp = last.outputs[0]
    if getattr(args, "json", False):
        m = last.metrics
        print(json.dumps({"text": comp.text, "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                          "prompt_tokens": len(last.prompt_token_ids),
                          "ttft_s": m.time_to_first_token,
                          "total_s": None if m.finished_time is None else m.finished_time - m.arrival_time}))
    else:
        if comp.text.startswith(shown):
            sys.stdout.write(comp.text[len(shown):])
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0
