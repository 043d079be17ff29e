"""A mixed step (prompt chunks beside sequences adding one token): the one-token rows go through the decode kernel.

``build_step`` records them (``StepMetadata.decode_rows``); ``KVCache.prefill``
attends them with the decode kernel and passes them to the prefill kernel as
``skip_rows``. Checked on the CPU interpreter, float32: every row of the
output (poisoned with NaN first) equals float64 attention over what the
kernels must read -- the pages, dequantized, for everything but a chunk's own
tokens, which come exact from k/v -- and each kernel gets exactly its rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from .test_runtime import make_cache

TOL = 1e-3
"""Relative L2 bound: float32 kernels round 16-bit pages' dots (fp16: ~1e-4); a row attended over the wrong
keys, or by no kernel, is off by far more."""


def _reference(cache, seq_ids, n_new, q, k, v, exact, layer=0):
    """float64 attention of each step row: the own new keys of the sequences ``exact`` (indices) exact, from
    k/v; every other key dequantized from the pages."""
    G = cache.num_q_heads // cache.num_kv_heads
    out, row = [], 0
    for b, (sid, n) in enumerate(zip(seq_ids, n_new)):
        ks, vs = (t.double() for t in cache.read_kv(layer, sid))  # [H, L, D], this step's tokens included
        L = ks.shape[1]
        if b in exact:
            ks[:, L - n:] = k[row:row + n].permute(1, 0, 2).double()
            vs[:, L - n:] = v[row:row + n].permute(1, 0, 2).double()
        for t in range(n):
            pos = L - n + t
            qt = q[row + t].double().view(cache.num_kv_heads, G, -1)
            s = torch.einsum("hgd,hld->hgl", qt, ks[:, :pos + 1]) / math.sqrt(cache.head_dim)
            out.append(torch.einsum("hgl,hld->hgd", s.softmax(-1), vs[:, :pos + 1]).reshape(-1, cache.head_dim))
        row += n
    return torch.stack(out)


def _spy(monkeypatch, cache):
    calls = []
    for op in ("decode", "prefill"):
        module = cache.kernels[op]
        original = module.launch

        def launch(*args, _op=op, _original=original, **kwargs):
            calls.append((_op, args[0].shape[0], tuple(kwargs.get("skip_rows", ()))))
            return _original(*args, **kwargs)
        monkeypatch.setattr(module, "launch", launch)
    return calls


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp16"])  # (bfloat16 pages: wrong in the interpreter)
def test_mixed_step_attends_one_token_rows_with_the_decode_kernel(scheme, monkeypatch):
    cache = make_cache(scheme, max_tokens=2048, num_layers=1, dtype="float32")
    P = cache.page_size
    ids = ["a", "b", "c", "d"]
    for s in ids:
        cache.add(s)
    g = torch.Generator().manual_seed(5)
    H, Hq, D = cache.num_kv_heads, cache.num_q_heads, cache.head_dim

    def step(n_new, spy=None):
        cache.plan_step(ids, n_new)
        total = sum(n_new)
        q, k, v = (torch.randn(total, h, D, generator=g) for h in (Hq, H, H))
        out = torch.full_like(q, float("nan"))
        cache.prefill(0, q, k, v, out=out)
        return q, k, v, out

    step([3 * P + 5, 2 * P + 1, P - 1, 5])  # prompts, every one of several tokens
    calls = _spy(monkeypatch, cache)
    n_new = [1, P + 3, 0, 1]  # a decode row at a page end's neighbour, a chunk, an idle row, a decode row
    q, k, v, out = step(n_new)
    assert cache.step.decode_rows.rows == (0, 3)
    assert calls == [("decode", 2, ()), ("prefill", sum(n_new), (0, 3))]
    ref = _reference(cache, ids, n_new, q, k, v, exact={1})  # the decode rows read their new token's page
    assert not out.isnan().any()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, err
    calls.clear()
    q, k, v, out = step([1, 1, 0, 1])  # one-token rows and an idle one: no chunk, nothing split off
    assert cache.step.decode_rows is None and calls == [("prefill", 3, ())]
    calls.clear()
    q, k, v, out = step([1, 1, 1, 1])  # a decode step run through prefill
    assert cache.step.decode_rows is None and calls == [("prefill", 4, ())]
    ref = _reference(cache, ids, [1] * 4, q, k, v, exact={0, 1, 2, 3})  # the prefill kernel: exact, from k/v
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, err


def test_a_package_without_skip_rows_attends_every_row_with_prefill(monkeypatch):
    """A prefill module generated before ``skip_rows`` (no ``SKIPS_ROWS``) keeps every row: no decode launch."""
    cache = make_cache("int8", max_tokens=1024, num_layers=1, dtype="float32")
    monkeypatch.delattr(cache.kernels["prefill"], "SKIPS_ROWS")
    for s in ("a", "b"):
        cache.add(s)
    cache.plan_step(["a", "b"], [20, 20])
    H, Hq, D = cache.num_kv_heads, cache.num_q_heads, cache.head_dim
    cache.prefill(0, torch.randn(40, Hq, D), torch.randn(40, H, D), torch.randn(40, H, D))
    calls = _spy(monkeypatch, cache)
    cache.plan_step(["a", "b"], [1, 9])
    assert cache.step.decode_rows.rows == (0,) and "decode" not in cache.step.configs
    out = cache.prefill(0, torch.randn(10, Hq, D), torch.randn(10, H, D), torch.randn(10, H, D))
    assert calls == [("prefill", 10, ())] and not out.isnan().any()


def test_prefill_refuses_bad_skip_rows():
    cache = make_cache("int8", max_tokens=1024, num_layers=1, dtype="float32")
    cache.add("a")
    cache.plan_step(["a"], [4])
    H, Hq, D = cache.num_kv_heads, cache.num_q_heads, cache.head_dim
    q, k, v = torch.randn(4, Hq, D), torch.randn(4, H, D), torch.randn(4, H, D)
    cache.prefill(0, q, k, v)
    module, step = cache.kernels["prefill"], cache.step
    for bad in ((1,), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="^skip_rows must"):
            module.launch(q, torch.empty_like(q), cache.pools[0], step.block_tables, step.seq_lens,
                          step.num_compressed, step.cu_seqlens_q, 4, 1.0, k_new=k, v_new=v, skip_rows=bad)
