"""The runtime (kvgen.runtime.KVCache) against float64 references, with the real generated kernels.

Kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1),
so shapes are small: a 2-layer model with 2 KV heads, 4 query heads and
head_dim 16, 16-token pages. The reference is float64 attention over what
the cache should hold: the scheme's own torch quantize/dequantize for
compressed pages, the exact K/V for residual pages -- except that
``prefill(layer, q, k, v)`` attends the step's own tokens from the given k/v
exactly (only the earlier tokens from the pages), while ``append_kv`` then
``prefill(layer, q, None, None)`` and ``decode`` read every key from the pages.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from kvgen.codegen.loader import load_kernel
from kvgen.codegen.package import kernel_specs, plan_scheme
from kvgen.models import ModelSpec
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.runtime import COMPRESSED, RESIDUAL, KVCache, KvgenRuntimeError, OutOfPages, UnknownSequence, load
from kvgen.runtime.page_pool import pool_sizes
from kvgen.targets import resolve_target

H, HQ, D = 2, 4, 8
G = HQ // H
SCHEMES = [s for s in ("fp32", "int8", "int4", "int2") if s in default_registry().schemes]

SPEC = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_q_heads=HQ, num_kv_heads=H, head_dim=D,
                 intermediate_size=128, vocab_size=256, max_positions=2048, rope_theta=10000.0,
                 sliding_window=None, tied_embeddings=True, num_params=100_000, architecture="LlamaForCausalLM")
# The 'cpu' preset with 3 GiB: a budget of ~0.7 GiB keeps the planner's pools (allocated on 'meta') small.
TARGET = dataclasses.replace(resolve_target("cpu"), memory_bytes=3 * 2**30)


def make_plan_for(scheme: str):
    return make_plan(SPEC, TARGET, Workload(context=1024, concurrency=4, compute_dtype="float32"),
                     default_registry().schemes, kv=scheme)


_KERNELS: dict[str, dict] = {}


def kernels_for(scheme: str) -> dict:
    """The kernels of ``scheme`` (a name, or NAME:key=value with options) for the tiny plan."""
    if scheme not in _KERNELS:
        reg = default_registry()
        plan = make_plan_for(scheme)
        configured = plan_scheme(plan, reg)
        _KERNELS[scheme] = {op: load_kernel(s, configured, reg)
                            for op, s in kernel_specs(plan, reg, configured).items()}
    return _KERNELS[scheme]


def make_cache(scheme: str, max_tokens: int = 1024, num_layers: int = 2, **kw) -> KVCache:
    plan = make_plan_for(scheme)
    return load(plan.to_json(), kernels_for(scheme), device="cpu", max_tokens=max_tokens,
                num_layers=num_layers, autotune=False, **kw)


def fake_kernels(log: list) -> dict:
    """Modules with the generated API that only record their launches."""
    mods = {}
    for op in ("decode", "prefill", "cache_write", "page_copy", "page_quantize", "dequant"):
        m = types.ModuleType(f"fake_{op}")
        m.default_config = lambda *shape, device=None, op=op: {"op": op, "shape": list(shape)}

        def launch(*args, op=op, **kwargs):
            log.append((op, args, kwargs))

        m.launch = launch
        mods[op] = m
    return mods


# ------------------------------------------------------------------ reference


def expected_cache(scheme_name: str, k: torch.Tensor, v: torch.Tensor, num_compressed: int, page: int):
    """What the cache should hold for exact K/V ``[n, H, D]``: quantized pages then exact residual tokens."""
    scheme = default_registry().schemes[scheme_name]
    n = k.shape[0]
    if scheme.residual_tokens is None:
        num_compressed = -(-n // page)
    ks, vs = [], []
    for p in range(num_compressed):
        kp = k[p * page:(p + 1) * page].permute(1, 0, 2).float()
        vp = v[p * page:(p + 1) * page].permute(1, 0, 2).float()
        rows = kp.shape[1]
        if rows < page:  # a per-token scheme's partial page: pad, quantize, cut
            kp = torch.nn.functional.pad(kp, (0, 0, 0, page - rows))
            vp = torch.nn.functional.pad(vp, (0, 0, 0, page - rows))
        dk, dv = scheme.dequantize_page(scheme.quantize_page(kp, vp), D)
        ks.append(dk[:, :rows].permute(1, 0, 2))
        vs.append(dv[:, :rows].permute(1, 0, 2))
    ks.append(k[num_compressed * page:].float())
    vs.append(v[num_compressed * page:].float())
    return torch.cat(ks).double(), torch.cat(vs).double()


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of the last ``len(q)`` positions: q [T, Hq, D], k/v [S, H, D]."""
    T, S = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(G, dim=1)
    vv = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * D ** -0.5
    visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Truth:
    """Exact K/V of every sequence and layer, to build references from."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: dict = {}
        self.v: dict = {}

    def append(self, layer, sid, k, v):
        key = (layer, sid)
        self.k[key] = torch.cat([self.k.get(key, torch.empty(0, H, D)), k])
        self.v[key] = torch.cat([self.v.get(key, torch.empty(0, H, D)), v])

    def reference(self, layer, sid, q, exact=False, fresh=0):
        """Attention of ``q`` (the last tokens) over the cache; ``fresh``: the last tokens whose K/V are exact."""
        k, v = self.k[(layer, sid)], self.v[(layer, sid)]
        if not exact:
            bm = self.cache.block_manager
            ek, ev = expected_cache(self.cache.scheme, k, v, bm.num_compressed(sid), self.cache.page_size)
            n = k.shape[0]
            k = torch.cat([ek[:n - fresh], k[n - fresh:].double()])
            v = torch.cat([ev[:n - fresh], v[n - fresh:].double()])
        return ref_attention(q, k, v)


def run_step(cache: KVCache, truth: Truth, seq_ids, counts, gen, mode="prefill"):
    """One model step over every layer; returns per layer (output, reference, exact reference).

    ``mode``: ``prefill`` -- ``prefill(layer, q, k, v)``, the step's own tokens attended
    exactly; ``pages`` -- ``append_kv`` then ``prefill(layer, q, None, None)``, every key
    from the pages; ``decode`` -- ``append_kv`` then ``decode``.
    """
    cache.plan_step(seq_ids, counts)
    total = sum(counts)
    results = []
    for layer in range(cache.num_layers):
        q = torch.randn(total, HQ, D, generator=gen)
        k = torch.randn(total, H, D, generator=gen)
        v = torch.randn(total, H, D, generator=gen)
        if mode == "decode":
            cache.append_kv(layer, seq_ids, k, v)
            out = cache.decode(layer, q, seq_ids)
        elif mode == "pages":
            cache.append_kv(layer, seq_ids, k, v)
            out = cache.prefill(layer, q, None, None, seq_ids)
        else:
            out = cache.prefill(layer, q, k, v, seq_ids)
        refs, exacts = [], []
        start = 0
        for sid, n in zip(seq_ids, counts):
            truth.append(layer, sid, k[start:start + n], v[start:start + n])
            refs.append(truth.reference(layer, sid, q[start:start + n], fresh=n if mode == "prefill" else 0))
            exacts.append(truth.reference(layer, sid, q[start:start + n], exact=True))
            start += n
        results.append((out, torch.cat(refs), torch.cat(exacts)))
    return results


def check(results, scheme: str, exact_bound: float):
    tol = max(default_registry().schemes[scheme].tolerance, 1e-5)
    for out, ref, exact in results:
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < tol, (scheme, rel_err(out, ref))
        assert rel_err(out, exact) < exact_bound, (scheme, rel_err(out, exact))


EXACT_BOUND = {"fp32": 1e-5, "int8": 2e-2, "int4": 0.2, "int2": 0.5}


# ------------------------------------------------------------------ allocation


@pytest.mark.parametrize("scheme", SCHEMES)
def test_allocation_matches_planner_capacity(scheme):
    plan = make_plan_for(scheme)
    fake = fake_kernels([])
    cache = load(plan.to_json(), fake, device="meta", autotune=False)
    assert (cache.num_pages, cache.num_residual_pages) == (plan.num_pages, plan.num_residual_pages)
    assert abs(cache.capacity_tokens - plan.capacity_tokens) <= 0.02 * plan.capacity_tokens
    per_token = cache.allocated_bytes(COMPRESSED) / (cache.num_pages * cache.page_size)
    assert abs(per_token - plan.kv_bytes_per_token_per_gpu) <= 0.02 * plan.kv_bytes_per_token_per_gpu
    total = cache.allocated_bytes()
    assert abs(total - plan.kv_budget_bytes) <= 0.02 * plan.kv_budget_bytes
    if plan.num_residual_pages:
        res = cache.allocated_bytes(RESIDUAL) / (cache.num_residual_pages * cache.page_size)
        assert res == plan.residual_bytes_per_token_per_gpu
    # every layer holds the plan's tensors, [pages, H, *shape]
    for pool in cache.pools:
        for t in plan.page_tensors:
            assert list(pool[t["name"]].shape) == [plan.num_pages, H, *t["shape"]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_max_tokens_shrinks_pool(scheme):
    plan = make_plan_for(scheme)
    c, r = pool_sizes(plan.to_json(), max_tokens=4096)
    P = plan.page_size
    if plan.num_residual_pages == 0:
        assert (c, r) == (4096 // P, 0)
    else:
        per_seq = plan.scheme_params["residual_tokens"] // P + 1
        assert r >= 4 * per_seq  # room for a few sequences' tails
        assert c + r == 4096 // P
        assert pool_sizes(plan.to_json(), 4096, max_seqs=10)[1] >= 10 * per_seq
    cache = load(plan.to_json(), fake_kernels([]), device="meta", max_tokens=4096, autotune=False)
    assert (cache.num_pages, cache.num_residual_pages) == (c, r)
    with pytest.raises(KvgenRuntimeError):
        pool_sizes(plan.to_json(), max_tokens=0)


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_decode_chunks_match_reference(scheme):
    residual = default_registry().schemes[scheme].residual_tokens or 0
    cache = make_cache(scheme, max_tokens=2048, num_layers=1)
    truth = Truth(cache)
    gen = torch.Generator().manual_seed(1)
    ids = ["a", "b", "c"]
    for sid in ids:
        assert cache.add(sid) == 0
    # a crosses pages (and, for residual schemes, converts); b fills its page during decode.
    check(run_step(cache, truth, ids, [37 + residual, 14, 16], gen), scheme, EXACT_BOUND[scheme])
    for _ in range(2):
        check(run_step(cache, truth, ids, [1, 1, 1], gen, mode="decode"), scheme, EXACT_BOUND[scheme])
    assert cache.seq_len("b") == 16
    check(run_step(cache, truth, ids, [3, 0, 7], gen), scheme, EXACT_BOUND[scheme])  # chunked prefill, one idle
    assert [cache.seq_len(s) for s in ids] == [42 + residual, 16, 25]
    if default_registry().schemes[scheme].residual_tokens is not None:
        assert cache.block_manager.num_compressed("a") == (42 + residual) // 16 - residual // 16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_fresh_chunk_vs_pages(scheme):
    """prefill(q, k, v) attends the step's own tokens exactly; append_kv + prefill(q, None, None) reads them
    back from the pages. Both match their references; for a lossy scheme they differ (the chunks reach
    compressed pages), for fp32 they agree. The pages hold the same data either way."""
    residual = default_registry().schemes[scheme].residual_tokens or 0
    outs, kv = {}, {}
    for mode in ("prefill", "pages"):
        # zeroed pools: read_kv dequantizes whole pages, and garbage in a tail page's unwritten slots overflows
        cache = make_cache(scheme, max_tokens=2048, num_layers=1, zero=True)
        truth = Truth(cache)
        gen = torch.Generator().manual_seed(6)
        ids = ["a", "b"]
        for sid in ids:
            cache.add(sid)
        # whole prompts (a's is longer than the residual window), then chunks after prefixes that end mid-page
        first = run_step(cache, truth, ids, [20 + residual, 5], gen, mode=mode)
        second = run_step(cache, truth, ids, [19, 16 + residual], gen, mode=mode)
        for results in (first, second):
            check(results, scheme, EXACT_BOUND[scheme])
        outs[mode] = torch.cat([first[0][0], second[0][0]])
        kv[mode] = [cache.read_kv(0, sid) for sid in ids]
    for (ka, va), (kb, vb) in zip(kv["prefill"], kv["pages"]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    diff = rel_err(outs["prefill"], outs["pages"])  # float32 kernels: ~1e-7 apart when they agree
    if scheme == "fp32":
        assert diff < 1e-6
    else:
        assert diff > 1e-3, f"k/v given, yet the output equals the all-from-pages one ({diff:.1e})"


@pytest.mark.parametrize("scheme", [s for s in ("int4", "int2") if s in SCHEMES][:1])
def test_conversion_and_new_page_in_one_step(scheme):
    """x's page fills (converted, its residual page released) while y takes a new page in the same step."""
    residual = default_registry().schemes[scheme].residual_tokens
    cache = make_cache(scheme, max_tokens=1024, num_layers=1)
    truth = Truth(cache)
    gen = torch.Generator().manual_seed(2)
    cache.add("x")
    cache.add("y")
    run_step(cache, truth, ["x", "y"], [15 + residual, 16 + residual], gen)
    tail_x = cache.block_manager.block_table("x")[-1]
    results = run_step(cache, truth, ["x", "y"], [1, 1], gen, mode="decode")
    step = cache.step
    assert step.num_conversions >= 1
    assert cache.block_manager.block_table("y")[-1] != tail_x  # never written while awaiting conversion
    check(results, scheme, EXACT_BOUND[scheme])


@pytest.mark.parametrize("scheme", [s for s in ("fp32", "int4") if s in SCHEMES])
def test_fork_copy_on_write_keeps_parent(scheme):
    cache = make_cache(scheme, max_tokens=1024, num_layers=1)
    truth = Truth(cache)
    gen = torch.Generator().manual_seed(3)
    cache.add("p")
    run_step(cache, truth, ["p"], [21], gen)
    cache.fork("p", "c")
    for key in list(truth.k):
        truth.k[(key[0], "c")], truth.v[(key[0], "c")] = truth.k[key], truth.v[key]
    parent_table = cache.block_manager.block_table("p")
    parent_kv = cache.read_kv(0, "p")
    # The child writes into the shared tail page first: it must copy it.
    run_step(cache, truth, ["c"], [1], gen, mode="decode")
    assert cache.step.num_copies == 1
    assert cache.block_manager.block_table("p") == parent_table
    for before, after in zip(parent_kv, cache.read_kv(0, "p")):
        assert torch.equal(before, after)  # the parent's pages are untouched
    assert cache.block_manager.block_table("c")[-1] != parent_table[-1]
    # Both advance; the parent's output sees only its own tokens.
    results = run_step(cache, truth, ["p", "c"], [1, 1], gen, mode="decode")
    check(results, scheme, EXACT_BOUND[scheme])
    assert truth.k[(0, "p")].shape[0] == 22 and truth.k[(0, "c")].shape[0] == 23


@pytest.mark.parametrize("scheme", [s for s in ("fp32", "int8", "int4") if s in SCHEMES])
def test_prefix_hit_gives_identical_decode(scheme):
    cache = make_cache(scheme, max_tokens=1024, num_layers=1)
    gen = torch.Generator().manual_seed(4)
    table_k = torch.randn(512, H, D, generator=gen)
    table_v = torch.randn(512, H, D, generator=gen)
    toks = list(range(100, 140))  # 40 tokens: two full pages and a partial one
    assert cache.add("A", toks) == 0
    cache.plan_step(["A"], [40], token_ids=[toks])
    cache.prefill(0, torch.randn(40, HQ, D, generator=gen), table_k[toks], table_v[toks], ["A"])
    hit = cache.add("B", toks)
    assert hit == 32
    assert cache.block_manager.block_table("B")[:2] == cache.block_manager.block_table("A")[:2]
    rest = toks[hit:]
    cache.plan_step(["B"], [len(rest)], token_ids=[rest])
    cache.prefill(0, torch.randn(len(rest), HQ, D, generator=gen), table_k[rest], table_v[rest], ["B"])
    cache.plan_step(["A", "B"], [1, 1], token_ids=[[7], [7]])
    q = torch.randn(1, HQ, D, generator=gen).expand(2, HQ, D)
    out = cache.decode(0, q, ["A", "B"], table_k[[7, 7]], table_v[[7, 7]])
    assert torch.equal(out[0], out[1])
    allk = table_k[toks + [7]]
    allv = table_v[toks + [7]]
    ref = ref_attention(q[:1], *expected_cache(scheme, allk, allv, cache.block_manager.num_compressed("A"), 16))
    assert rel_err(out[:1], ref) < max(default_registry().schemes[scheme].tolerance, 1e-5)


@pytest.mark.parametrize("scheme", [s for s in ("int4:residual=32", "int2") if s.split(":")[0] in SCHEMES])
def test_fork_then_window_conversion_keeps_every_sequence_intact(scheme):
    """Issue 13, item 1: prefill A with token ids, fork B, then one decode step [A, B, C] in which A's
    oldest residual page leaves the window. A converts it (registering the compressed page), B reuses
    that compressed page and drops the shared residual page -- still the source of A's pending
    conversion -- and C's new tokens must not be written into it before the conversion reads it."""
    residual = default_registry().scheme(scheme).residual_tokens
    P = 16
    cache = make_cache(scheme, max_tokens=1024, num_layers=1, zero=True)
    gen = torch.Generator().manual_seed(11)
    n = residual + P - 1  # one more token and the oldest page leaves the window
    toks = list(range(n))
    k = {sid: torch.randn(n, H, D, generator=gen) for sid in "A"}
    v = {sid: torch.randn(n, H, D, generator=gen) for sid in "A"}
    cache.add("A")
    cache.plan_step(["A"], [n], token_ids=[toks])
    cache.append_kv(0, ["A"], k["A"], v["A"])
    cache.fork("A", "B")
    k["B"], v["B"] = k["A"], v["A"]
    cache.add("C")
    k["C"] = v["C"] = torch.empty(0, H, D)
    step = cache.plan_step(["A", "B", "C"], [1, 1, P], token_ids=[[5], [5], list(range(P))])
    assert step.num_conversions >= 1
    new_k = torch.full((P + 2, H, D), 999.0)  # C's K/V: far from anything A or B hold
    new_v = torch.randn(P + 2, H, D, generator=gen)
    cache.append_kv(0, ["A", "B", "C"], new_k, new_v)
    for sid, rows in (("A", slice(0, 1)), ("B", slice(1, 2)), ("C", slice(2, P + 2))):
        k[sid] = torch.cat([k[sid], new_k[rows]])
        v[sid] = torch.cat([v[sid], new_v[rows]])
        ek, ev = expected_cache(scheme.split(":")[0], k[sid], v[sid],
                                cache.block_manager.num_compressed(sid), P)
        got_k, got_v = cache.read_kv(0, sid)
        assert rel_err(got_k.permute(1, 0, 2), ek) < 1e-3, (sid, rel_err(got_k.permute(1, 0, 2), ek))
        assert rel_err(got_v.permute(1, 0, 2), ev) < 1e-3, (sid, rel_err(got_v.permute(1, 0, 2), ev))
    q = torch.randn(3, HQ, D, generator=gen)
    cache.plan_step(["A", "B", "C"], [1, 1, 1])
    kk, vv = torch.randn(3, H, D, generator=gen), torch.randn(3, H, D, generator=gen)
    out = cache.decode(0, q, ["A", "B", "C"], kk, vv)
    for b, sid in enumerate("ABC"):
        allk, allv = torch.cat([k[sid], kk[b:b + 1]]), torch.cat([v[sid], vv[b:b + 1]])
        ref = ref_attention(q[b:b + 1], *expected_cache(scheme.split(":")[0], allk, allv,
                                                          cache.block_manager.num_compressed(sid), P))
        assert rel_err(out[b:b + 1], ref) < 2e-3, (sid, rel_err(out[b:b + 1], ref))


# ------------------------------------------------------------------ errors and invariants


def test_out_of_pages_changes_nothing():
    cache = make_cache("fp32", max_tokens=64, num_layers=1)  # 4 pages of 16
    gen = torch.Generator().manual_seed(5)
    truth = Truth(cache)
    cache.add("a")
    cache.add("b")
    run_step(cache, truth, ["a", "b"], [40, 10], gen)
    bm = cache.block_manager
    before = ([bm.block_table(s) for s in "ab"], [bm.seq_len(s) for s in "ab"],
              bm.num_free_pages(COMPRESSED), cache.step)
    with pytest.raises(OutOfPages):
        cache.plan_step(["a", "b"], [10, 10])
    after = ([bm.block_table(s) for s in "ab"], [bm.seq_len(s) for s in "ab"],
             bm.num_free_pages(COMPRESSED), cache.step)
    assert after == before
    with pytest.raises(UnknownSequence):
        cache.plan_step(["a", "nope"], [1, 1])
    assert [bm.seq_len(s) for s in "ab"] == [40, 10]
    cache.free("b")
    results = run_step(cache, truth, ["a"], [10], gen)
    check(results, "fp32", EXACT_BOUND["fp32"])


def test_step_misuse_raises_clear_errors():
    cache = make_cache("fp32", max_tokens=256, num_layers=1)
    cache.add("a")
    cache.add("b")
    with pytest.raises(KvgenRuntimeError, match="plan_step"):
        cache.decode(0, torch.zeros(1, HQ, D), ["a"])
    cache.plan_step(["a", "b"], [3, 2])
    k = torch.zeros(5, H, D)
    with pytest.raises(KvgenRuntimeError, match="not the planned step"):
        cache.append_kv(0, ["b", "a"], k, k)
    with pytest.raises(KvgenRuntimeError, match="must be"):
        cache.append_kv(0, ["a", "b"], k[:4], k[:4])
    with pytest.raises(KvgenRuntimeError, match="not written"):
        cache.prefill(0, torch.zeros(5, HQ, D), None, None, ["a", "b"])
    with pytest.raises(KvgenRuntimeError, match="both k and v"):
        cache.prefill(0, torch.zeros(5, HQ, D), k, None, ["a", "b"])
    with pytest.raises(KvgenRuntimeError, match="one token per sequence"):
        cache.decode(0, torch.zeros(2, HQ, D), ["a", "b"], k[:2], k[:2])
    cache.append_kv(0, ["a", "b"], k, k)
    with pytest.raises(KvgenRuntimeError, match="already written"):
        cache.append_kv(0, ["a", "b"], k, k)
    with pytest.raises(KvgenRuntimeError, match="layer"):
        cache.append_kv(3, ["a", "b"], k, k)
    with pytest.raises(KvgenRuntimeError, match="twice"):
        cache.plan_step(["a", "a"], [1, 1])
    with pytest.raises(KvgenRuntimeError, match="compiled for"):
        make_cache("fp32", dtype=torch.float16)
    with pytest.raises(KvgenRuntimeError, match="tp"):
        make_cache("fp32", tp_size=2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_random_steps_are_all_or_nothing(scheme):
    """Random adds, forks, frees and batched steps on small pools ('meta': bookkeeping only):
    every step either succeeds or raises OutOfPages with the block manager untouched."""
    import random

    plan = make_plan_for(scheme)
    for trial in range(12):
        rnd = random.Random(trial)
        cache = load(plan.to_json(), fake_kernels([]), device="meta", max_tokens=rnd.choice([256, 512, 1024]),
                     autotune=False, max_seqs=rnd.choice([1, 2, 4]))
        bm = cache.block_manager
        live: list = []
        outcomes = {"ok": 0, "oop": 0}
        for step in range(50):
            r = rnd.random()
            if r < 0.15 or not live:
                live.append(f"s{step}")
                cache.add(live[-1], [rnd.randint(0, 3) for _ in range(rnd.randint(0, 80))])
            elif r < 0.25:
                parent = rnd.choice(live)
                live.append(f"f{step}")
                cache.fork(parent, live[-1])
            elif r < 0.32 and len(live) > 1:
                cache.free(live.pop(rnd.randrange(len(live))))
            batch = rnd.sample(live, min(len(live), rnd.randint(1, 4)))
            counts = [rnd.choice([1, 1, 1, rnd.randint(0, 200)]) for _ in batch]
            ids = [[rnd.randint(0, 3) for _ in range(c)] for c in counts] if rnd.random() < 0.7 else None
            snap = ([bm.block_table(s) for s in live], [bm.seq_len(s) for s in live],
                    bm.num_free_pages(COMPRESSED), bm.num_free_pages(RESIDUAL))
            try:
                step_meta = cache.plan_step(batch, counts, token_ids=ids)
            except OutOfPages:
                outcomes["oop"] += 1
                assert snap == ([bm.block_table(s) for s in live], [bm.seq_len(s) for s in live],
                                bm.num_free_pages(COMPRESSED), bm.num_free_pages(RESIDUAL))
                cache.free(live.pop(rnd.randrange(len(live))))
                continue
            outcomes["ok"] += 1
            assert step_meta.total_tokens == sum(counts) == step_meta.phases[-1].end
            assert [bm.seq_len(s) for s in batch] == list(step_meta.seq_lens_host)
            assert sorted(map(str, bm.sequences())) == sorted(live)  # no parked hold sequences left
        assert outcomes["ok"] > 0
