"""The engine on a workload needing 2x the device's KV capacity: preemption by swap vs by recompute (issue 17).

:func:`engine_records` builds the engine twice in this process with the same
random weights (seed 0), the same device KV budget (``max_tokens``) and the
same requests: once with a host tier (``host_tokens``: preempted sequences'
pages go to pinned host memory and come back, ``preemption_mode="swap"``),
once without (``"recompute"``: a preempted sequence is fed again). The budget
is the requests' whole KV (prompt + output, page-rounded) divided by
``ratio`` (2), so every request cannot be resident at once. Each engine first
runs two warm-up requests (longest prompt, 2 output tokens: Triton compiles, first-use costs), then the
timed offline loop (:func:`benchmarks.offline.run_offline`). Records:
``op`` ``engine_swap`` / ``engine_recompute`` with ``tokens_per_s``
(generated tokens over the loop's wall seconds), ``wall_s``,
``num_preemptions``, ``swapped_out`` / ``swapped_in`` / ``swap_failures``,
``max_tokens``, ``workload_tokens`` and ``kv_ratio`` (their quotient).
"""

from __future__ import annotations

import gc
import json
import random
import sys

from kvgen.engine.config import DEFAULT_ENGINE_BACKEND  # the backend the engines here are asked for (recorded)

TINY = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True, torch_dtype="float32")
"""The smoke's model (CPU, interpreted kernels): a Llama of the same code path, tiny."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def requests(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0):
    """``n`` (prompt ids, output tokens) pairs, lengths uniform in the given ranges (seeded)."""
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def workload_tokens(reqs, page: int) -> int:
    """Tokens of KV pages the requests hold at their ends, all together (each rounded up to whole pages)."""
    return sum(-(-(len(p) + n) // page) * page for p, n in reqs)


def engine_records(*, smoke: bool, kv: str, num_requests: int, prompt: tuple[int, int], output: tuple[int, int],
                   ratio: float = 2.0, modes=("swap", "recompute")) -> list[dict]:
    """One record per preemption mode (see the module docstring); the same requests for each."""
    import torch

    from benchmarks.offline import run_offline
    from kvgen.engine.loader import build_engine

    if smoke:
        config, dtype, device, sync = TINY, "float32", "cpu", (lambda: None)
    else:
        from benchmarks.engine import LLAMA3_8B

        config, dtype, device, sync = LLAMA3_8B, "bfloat16", "cuda", torch.cuda.synchronize
    reqs = requests(num_requests, prompt, output, config["vocab_size"])
    warm = requests(2, (prompt[1], prompt[1]), (2, 2), config["vocab_size"], seed=1)
    max_model_len = prompt[1] + output[1]
    page = 8 if smoke else 16  # smoke: small pages, so short sequences cross page boundaries and preempt
    need = workload_tokens(reqs, page)
    max_tokens = -(-int(need / ratio) // page) * page
    out = []
    for mode in modes:
        eng = build_engine(config=config, kv=kv, dtype=dtype, device=device, max_model_len=max_model_len,
                           max_num_seqs=num_requests, max_tokens=max_tokens, page_size=page, autotune=False,
                           verbose=not smoke, host_tokens=need if mode == "swap" else None, preemption_mode=mode)
        run_offline(eng, warm, sync)
        s = eng.scheduler
        before = (s.num_preemptions, s.num_swapped_out, s.num_swapped_in, s.num_swap_failures)
        generated, wall = run_offline(eng, reqs, sync)
        after = (s.num_preemptions, s.num_swapped_out, s.num_swapped_in, s.num_swap_failures)
        d = [a - b for a, b in zip(after, before)]
        rec = dict(op=f"engine_{mode}", scheme=kv, host_fraction=None, requests=num_requests,
                   prompt_tokens=list(prompt), output_tokens=list(output), generated=generated, wall_s=wall,
                   ms=wall * 1e3, tokens_per_s=generated / wall, num_preemptions=d[0], swapped_out=d[1],
                   swapped_in=d[2], swap_failures=d[3], max_tokens=eng.cache.capacity_tokens,
                   workload_tokens=need, kv_ratio=need / eng.cache.capacity_tokens,
                   peak_running=getattr(eng, "peak_running", None), bytes=None, bw_fraction=None,
                   kernel_backend=DEFAULT_ENGINE_BACKEND)
        log(json.dumps(rec))
        out.append(rec)
        del eng, s
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out
