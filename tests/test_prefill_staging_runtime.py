"""KVCache.prefill resolves the prefill kernel's per-step choices (``step_config``) from the step's lengths.

The kernel module decides whether staging pays from each sequence's query
and cached length (host ints the runtime has in its step metadata); the
runtime passes them per step. A chunk over a cached prefix stages, a step
of decode rows does not, and the output is the same either way.
"""

from __future__ import annotations

import torch

from .test_runtime import make_cache


def _prefill(cache, seq_ids, n_new, seed):
    g = torch.Generator().manual_seed(seed)
    H, D, Hq = cache.num_kv_heads, cache.head_dim, cache.num_q_heads
    total = sum(n_new)
    cache.plan_step(seq_ids, n_new)
    q = torch.randn(total, Hq, D, generator=g)
    k, v = torch.randn(total, H, D, generator=g), torch.randn(total, H, D, generator=g)
    return cache.prefill(0, q, k, v)


def test_prefill_passes_each_steps_lengths_to_step_config(monkeypatch):
    cache = make_cache("int8", max_tokens=1024, num_layers=1)
    module = cache.kernels["prefill"]
    assert module.STAGEABLE
    seen = []
    original_launch, original_refine = module.launch, module.step_config

    def refine(config, num_new, seq_lens, fresh):
        out = original_refine(config, num_new, seq_lens, fresh)
        seen.append((tuple(num_new), tuple(seq_lens), fresh, out["staged"], out.get("stage_rows"),
                     out.get("fresh_rows")))
        return out

    def launch(*args, config=None, **kwargs):
        assert config["staged"] in (0, 1)  # resolved before the launch
        return original_launch(*args, config=config, **kwargs)
    monkeypatch.setattr(module, "step_config", refine)
    monkeypatch.setattr(module, "launch", launch)
    staged_two = dict(module.default_config(1, 64, 256, device="cpu"), block_m=4, staged=2)
    monkeypatch.setattr(cache, "_config", lambda op, shape: dict(staged_two) if op == "prefill" else None)
    for s in ("a", "b"):
        cache.add(s)
    _prefill(cache, ["a", "b"], [200, 3], seed=1)  # first chunks: no prefix yet
    _prefill(cache, ["a", "b"], [100, 1], seed=2)  # a chunk over 200 cached tokens, a decode row
    _prefill(cache, ["a", "b"], [1, 1], seed=3)    # decode rows
    assert [x[:3] for x in seen] == [((200, 3), (200, 3), True), ((100, 1), (300, 4), True),
                                     ((1, 1), (301, 5), True)]
    # the first chunk runs the staged kernel on its fresh keys alone, the second stages its prefix
    assert [x[3:] for x in seen] == [(1, (), (0,)), (1, (0,), None), (0, None, None)]
