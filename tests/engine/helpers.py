"""Shared pieces of the engine tests: a real KVCache without a model, and a stand-in runner.

The stand-in runner lets scheduler tests run thousands of steps: it never
launches a kernel (the interpreter would take ~0.2 s per sequence and step)
but the cache underneath is the real runtime, so every page the scheduler
reserves, forks, preempts or frees goes through the block manager.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "tests" / "assets" / "models" / "stories260K"


def stories_cache(max_tokens: int, kv: str = "fp32", max_seqs: int = 4, **load_kwargs):
    """A KVCache planned for stories260K (page 16) with about ``max_tokens`` tokens of pages.

    ``load_kwargs`` go to the runtime's load (``host_tokens=N`` for a host tier).
    """
    from transformers import AutoConfig

    from kvgen.integrations.transformers import compile_for_model, plan_for_model

    shim = types.SimpleNamespace(config=AutoConfig.from_pretrained(STORIES), dtype=torch.float32,
                                 device=torch.device("cpu"))
    plan = plan_for_model(shim, kv, device="cpu")
    return compile_for_model(plan).load(device="cpu", max_tokens=max_tokens, autotune=False, max_seqs=max_seqs,
                                        **load_kwargs)


class TableRunner:
    """Logits of a row = ``table[last input token]``: the next token depends only on the previous one.

    Deterministic whatever the batch, so a run under page pressure
    (preemption, recompute) must give the same tokens as one without.
    """

    def __init__(self, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g) * 3
        self.steps = []

    device_input_ids = True  # takes the ids as a tensor too (the engine's async scheduling)

    def run(self, step, input_ids, positions, sample_rows):
        assert len(input_ids) == len(positions) == step.total_tokens
        self.steps.append((step.batch, step.total_tokens, step.is_decode))
        if not sample_rows:
            return None
        if isinstance(input_ids, torch.Tensor):
            last = input_ids.index_select(0, torch.tensor(sample_rows, dtype=torch.long))
        else:
            last = torch.tensor([input_ids[r] for r in sample_rows])
        return self.table.index_select(0, last)

    def greedy(self, prompt, n):
        """The greedy continuation the engine must produce."""
        out, t = [], prompt[-1]
        for _ in range(n):
            t = int(self.table[t].argmax())
            out.append(t)
        return out


class CharTokenizer:
    """Token i is the letter ``chr(97 + i % 26)``: enough for stop-string tests."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def fake_engine(cache, runner=None, **kw):
    from kvgen.engine.engine import LLMEngine

    runner = runner or TableRunner()
    opts = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, vocab_size=runner.table.shape[0])
    opts.update(kw)
    return LLMEngine(runner, cache, kw.pop("tokenizer", None), **{k: v for k, v in opts.items() if k != "tokenizer"})


def all_free(cache) -> bool:
    """No sequence left, and every page of every pool (the host tier's too) free or evictable."""
    bm = cache.block_manager
    if getattr(cache, "host_tier", None) is not None:
        cache.wait_host_tier()  # pages a copy to the host still reads count as free once it ran
    pools = ["compressed", "residual", "host_compressed", "host_residual"]
    return not cache.sequences() and all(bm.num_free_pages(p) == bm._pool(p).size for p in pools)


def sm90_build(script: str, timeout: int = 900):
    """The JSON that ``tests/engine/<script>`` prints last, run in a fresh process without TRITON_INTERPRET (an
    offline sm_90 compile: Triton fixes interpreter or compiled mode at import, and this session imported it for
    the interpreter)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
