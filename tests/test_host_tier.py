"""The host tier of the runtime (KVCache with interpreted kernels; an ordinary CPU pool stands in for host memory).

- decode (and a pages-only prefill) with cold pages -- the oldest pages on
  the host, staged into the device ring before each layer's attention --
  gives exactly the outputs of an all-device cache for every built-in scheme
  (bf16 skipped on the CPU), two layers so both ring slots are used;
- swap_out / swap_in round trips page tensors bit-exactly (raw bytes, forks
  sharing pages included), and the pages return to their pools;
- a prefix-cache page evicted from the device spills to the host and a later
  prefix hit restores it with the original KV;
- host tier sizing and misuse errors.
"""

from __future__ import annotations

import pytest
import torch

from kvgen.registry import default_registry
from kvgen.runtime import COMPRESSED, RESIDUAL, KvgenRuntimeError, OutOfPages, load
from kvgen.runtime.errors import SwappedOut
from kvgen.runtime.pools import poison_
from kvgen.runtime.tiering import HOST_COMPRESSED

from .kernels import harness as hz
from .test_runtime_state_machine import D, H, HQ, case

# (scheme, compute dtype, page size): every built-in scheme; KIVI int2 with a one-page window so
# short sequences have compressed (hence possibly cold) pages.
SCHEMES = [("fp32", "float32", 8), ("fp16", "float16", 8), ("bf16", "float32", 8), ("int8", "float16", 8),
           ("fp8", "float32", 8), ("int4", "float32", 8), ("int2:residual=16", "float32", 16),
           ("nuq4", "float32", 8)]
SCHEMES = [s for s in SCHEMES if s[0].split(":")[0] in default_registry().schemes]
LAYERS = 2


def make(kv: str, dtype: str, page: int, host_tokens: int | None = None, max_tokens: int | None = None, **kw):
    reason = hz.skip_reason(default_registry().scheme(kv))
    if reason or (kv == "bf16" and hz.on_cpu()):
        pytest.skip(reason or "bf16 is unreliable in the Triton interpreter")
    c = case(kv, dtype, page, LAYERS)
    cache = load(c.plan, c.kernels, device=hz.device(), max_tokens=max_tokens or 24 * page, num_layers=LAYERS,
                 autotune=False, max_seqs=4, zero=True, host_tokens=host_tokens, **kw)
    return cache, c


def rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def prefill(caches, seqs: dict, gen, dtype):
    """Add the sequences to every cache and prefill them with the same random K/V (one step)."""
    ids = list(seqs)
    counts = [len(t) for t in seqs.values()]
    for cache in caches:
        for sid in ids:
            assert cache.add(sid) == 0
        cache.plan_step(ids, counts, token_ids=list(seqs.values()))
    n = sum(counts)
    for layer in range(LAYERS):
        q, k, v = rand(gen, n, HQ, D, dtype=dtype), rand(gen, n, H, D, dtype=dtype), rand(gen, n, H, D, dtype=dtype)
        for cache in caches:
            cache.prefill(layer, q, k, v, ids)


def raw_pages(cache, sid) -> list[dict[str, torch.Tensor]]:
    """Every page of the sequence in every layer, as raw bytes, read from whichever tier holds it."""
    bm = cache.block_manager
    table, nc, on_host = bm.block_table(sid), bm.num_compressed(sid), bm.host_pages(sid)
    out = []
    for layer in range(LAYERS):
        for i, page in enumerate(table):
            pool = COMPRESSED if i < nc else RESIDUAL
            if i < on_host:
                src = {n: t[layer] for n, t in cache.host_tier.pool.tensors[pool].items()}
            else:
                src = cache.page_pool.named(layer, pool)
            out.append({n: t[page].contiguous().view(torch.uint8).clone() for n, t in src.items()})
    return out


def same_raw(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("kv, dtype, page", SCHEMES, ids=[s[0] for s in SCHEMES])
def test_cold_pages_decode_equals_all_device_decode(kv, dtype, page):
    ref, c = make(kv, dtype, page)
    tier, _ = make(kv, dtype, page, host_tokens=16 * page, staging_tokens=8 * page)
    dt = c.dtype
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": list(range(5 * page + 3)), "b": list(range(100, 100 + 3 * page + 1)), "c": [7] * (page + 2)}
    prefill([ref, tier], seqs, gen, dt)
    bm = tier.block_manager
    for sid, want in (("a", 99), ("b", 1)):
        n = min(want, bm.num_compressed(sid), bm.seq_len(sid) // page)
        assert n >= 1, (sid, bm.num_compressed(sid))
        tier.make_cold(sid, n)
        assert bm.host_pages(sid) == n
    tier.wait_host_tier()
    free_before = bm.num_free_pages(COMPRESSED)
    assert free_before > ref.block_manager.num_free_pages(COMPRESSED)  # cold pages left the device
    free = torch.tensor(list(bm._pools[COMPRESSED].free))
    for layer in range(LAYERS):  # free device pages (the cold pages' old homes) must never be read
        for t in tier.page_pool.named(layer, COMPRESSED).values():
            t[free] = poison_(t[free].clone())
    for layer in range(LAYERS):
        for sid in seqs:
            assert all(torch.equal(x, y) for x, y in zip(tier.read_kv(layer, sid), ref.read_kv(layer, sid)))
    ids = ["b", "c", "a"]
    for step in range(3):
        counts = [2, 1, 2] if step == 1 else [1, 1, 1]
        steps = [cache.plan_step(ids, counts) for cache in (ref, tier)]
        assert steps[0].cold is None and steps[1].cold is not None
        if step > 0:  # the ring still holds the previous step's layers 0 and 1 of the same cold pages: reused
            assert tier.host_tier.holds(0, steps[1].cold.runs) and tier.host_tier.holds(1, steps[1].cold.runs)
            assert tier.host_tier.num_staged == staged
        staged = tier.host_tier.num_staged
        n = sum(counts)
        for layer in range(LAYERS):
            q, k, v = rand(gen, n, HQ, D, dtype=dt), rand(gen, n, H, D, dtype=dt), rand(gen, n, H, D, dtype=dt)
            outs = []
            for cache in (ref, tier):
                if step == 1:  # every key from the pages, the cold ones through the ring
                    cache.append_kv(layer, ids, k, v)
                    outs.append(cache.prefill(layer, q, None, None, ids))
                else:
                    outs.append(cache.decode(layer, q, ids, k, v))
            assert torch.isfinite(outs[0]).all()
            assert torch.equal(outs[0], outs[1]), (kv, step, layer, (outs[0] - outs[1]).abs().max())
    tier.swap_in(["a", "b"])  # cold pages back to the device: the same KV
    tier.wait_host_tier()
    assert bm.host_pages("a") == bm.host_pages("b") == 0 and bm.num_free_pages(HOST_COMPRESSED) == 16
    for layer in range(LAYERS):
        for sid in seqs:
            assert all(torch.equal(x, y) for x, y in zip(tier.read_kv(layer, sid), ref.read_kv(layer, sid)))


ROUND_TRIP = [s for s in SCHEMES if s[0] in ("fp16", "int8", "int4", "int2:residual=16", "fp8")]


@pytest.mark.parametrize("kv, dtype, page", ROUND_TRIP, ids=[s[0] for s in ROUND_TRIP])
def test_swap_round_trip_is_bit_exact(kv, dtype, page):
    cache, c = make(kv, dtype, page, host_tokens=24 * page)
    bm = cache.block_manager
    gen = torch.Generator().manual_seed(2)
    prefill([cache], {"a": list(range(3 * page + 5)), "c": list(range(50, 50 + 2 * page))}, gen, c.dtype)
    cache.fork("a", "b")  # shares every page of a
    pages = {sid: raw_pages(cache, sid) for sid in ("a", "b", "c")}
    kv_before = {sid: cache.read_kv(1, sid) for sid in ("a", "b", "c")}
    free = [bm.num_free_pages(p) for p in (COMPRESSED, RESIDUAL)]
    cache.swap_out(["a", "b"])
    cache.wait_host_tier()  # (CUDA: the freed pages are held until the copies ran)
    shared = len(bm.block_table("a"))
    assert bm.num_free_pages(HOST_COMPRESSED) + bm.num_free_pages("host_residual") == \
        bm._pools[HOST_COMPRESSED].size + bm._pools["host_residual"].size - shared  # shared pages copied once
    cache.swap_out(["c"])
    assert all(bm.is_swapped(s) for s in "abc")
    with pytest.raises(SwappedOut, match="swap_in"):
        cache.plan_step(["a"], [1])
    for sid in "abc":
        assert same_raw(raw_pages(cache, sid), pages[sid]), f"{sid} on the host differs"
        assert all(torch.equal(x, y) for x, y in zip(cache.read_kv(1, sid), kv_before[sid]))
    cache.swap_in(["c"])
    cache.swap_in(["a", "b"])
    cache.wait_host_tier()
    assert bm.block_table("a") == bm.block_table("b")  # swapped together: shared again
    assert [bm.num_free_pages(p) for p in (COMPRESSED, RESIDUAL)] == free
    assert bm.num_free_pages(HOST_COMPRESSED) == bm._pools[HOST_COMPRESSED].size
    for sid in "abc":
        assert same_raw(raw_pages(cache, sid), pages[sid]), f"{sid} after the round trip differs"
    # and the sequences step again, the fork copying its shared tail first
    cache.plan_step(["a", "b"], [1, 1])
    for layer in range(LAYERS):
        out = cache.decode(layer, rand(gen, 2, HQ, D, dtype=c.dtype), ["a", "b"],
                           rand(gen, 2, H, D, dtype=c.dtype), rand(gen, 2, H, D, dtype=c.dtype))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv, dtype, page", [s for s in SCHEMES if s[0] in ("fp32", "int4")])
def test_prefix_spill_and_restore_give_the_original_kv(kv, dtype, page):
    cache, c = make(kv, dtype, page, host_tokens=8 * page, max_tokens=8 * page)
    bm = cache.block_manager
    gen = torch.Generator().manual_seed(3)
    prompt = list(range(3 * page + 1))
    prefill([cache], {"a": prompt}, gen, c.dtype)
    original = [cache.read_kv(layer, "a") for layer in range(LAYERS)]
    cache.free("a")  # its full pages stay in the prefix cache
    cache.wait_host_tier()
    assert bm.num_free_pages(COMPRESSED) == cache.num_pages
    other = [1000 + i for i in range(cache.num_pages * page)]
    prefill([cache], {"x": other}, gen, c.dtype)  # needs the cached pages: evicted, spilled to the host
    assert len(bm._caches[HOST_COMPRESSED].hash_page) >= 3
    cache.free("x")
    hit = cache.add("b", prompt)
    assert hit == 3 * page
    for layer in range(LAYERS):
        k, v = cache.read_kv(layer, "b")
        assert torch.equal(k, original[layer][0][:, :hit]) and torch.equal(v, original[layer][1][:, :hit])
    # a cache without a host tier loses the prefix
    plain, _ = make(kv, dtype, page, max_tokens=8 * page)
    prefill([plain], {"a": prompt}, gen, c.dtype)
    plain.free("a")
    prefill([plain], {"x": other}, gen, c.dtype)
    plain.free("x")
    assert plain.add("b", prompt) == 0


def test_host_tier_sizes_and_misuse():
    kv, dtype, page = SCHEMES[0]
    cache, c = make(kv, dtype, page)
    assert cache.host_tier is None and cache.page_pool.staging_pages == 0
    cache.add("a")
    with pytest.raises(KvgenRuntimeError, match="host_tokens"):
        cache.swap_out(["a"])
    with pytest.raises(KvgenRuntimeError, match="host tier"):
        make(kv, dtype, page, host_tokens="plan")  # the tiny plan needs no host tier
    with pytest.raises(KvgenRuntimeError, match="host_tokens must be"):
        make(kv, dtype, page, host_tokens=-1)
    with pytest.raises(KvgenRuntimeError, match="staging_tokens needs a host tier"):
        make(kv, dtype, page, staging_tokens=8)
    cache, _ = make(kv, dtype, page, host_tokens=10 * page + 1, staging_tokens=page)
    assert cache.block_manager._pools[HOST_COMPRESSED].size == 11 and cache.page_pool.staging_pages == 1
    host = cache.host_tier.pool.tensors[COMPRESSED]
    assert [list(t.shape[:2]) for t in host.values()] == [[LAYERS, 11]] * len(host)
    # a step whose cold pages exceed the ring is refused with nothing changed
    gen = torch.Generator().manual_seed(4)
    prefill([cache], {"a": list(range(2 * page)), "b": list(range(2 * page))}, gen, c.dtype)
    cache.make_cold("a", 1)
    cache.make_cold("b", 1)
    with pytest.raises(OutOfPages, match="staging ring"):
        cache.plan_step(["a", "b"], [1, 1])
    assert cache.block_manager.seq_len("a") == 2 * page
    cache.plan_step(["a"], [1])


class _PendingCopy:
    """A stand-in CUDA event of a copy that has not finished (query False) until synchronized."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.mark.parametrize("tp_size,released", [(1, []), (2, [7])])
def test_held_pages_are_released_by_timing_only_without_tensor_parallelism(monkeypatch, tp_size, released):
    """With tp > 1 every rank must release held device pages at the same call, whatever its copies' timing."""
    cache, _ = make("int8", "float16", 8, host_tokens=8 * 8)
    got = []
    monkeypatch.setattr(cache.block_manager, "release_held", got.append)
    monkeypatch.setattr(cache, "tp_size", tp_size)
    cache._held = [(_PendingCopy(), 7)]
    cache._reap()
    assert got == released
    assert len(cache._held) == 1 - len(released)


def test_cold_pages_from_a_reused_host_pool_stage_in_one_copy_per_run():
    """A host pool hands reused ids out in any order (LIFO: descending in the table). The ring follows the
    host ids, so consecutive host pages still stage as one run, and decode still equals all-device decode.

    Before: ring positions in table order, so descending ids made every run one page long (on the H200,
    131K copies per step at 50% cold: 1.1 s instead of 0.16 s)."""
    kv, dtype, page = "fp16", "float16", 8
    ref, _ = make(kv, dtype, page)
    tier, _ = make(kv, dtype, page, host_tokens=16 * page, staging_tokens=8 * page)
    gen = torch.Generator().manual_seed(4)
    seqs = {"a": list(range(6 * page + 3))}
    prefill([ref, tier], seqs, gen, ref.dtype)
    bm = tier.block_manager
    tier.make_cold("a", 5)
    tier.swap_in(["a"])  # the host pages go back to the free list ...
    tier.make_cold("a", 5)  # ... and come out again in another order
    tier.wait_host_tier()
    host_ids = bm.block_table("a")[:5]
    assert sorted(host_ids) == list(range(min(host_ids), min(host_ids) + 5))  # consecutive, in whatever order
    steps = [cache.plan_step(["a"], 1) for cache in (ref, tier)]
    assert len(steps[1].cold.runs) == 1, steps[1].cold.runs
    for layer in range(LAYERS):
        q, k, v = rand(gen, 1, HQ, D, dtype=ref.dtype), rand(gen, 1, H, D, dtype=ref.dtype), rand(gen, 1, H, D,
                                                                                                    dtype=ref.dtype)
        outs = [cache.decode(layer, q, ["a"], k, v) for cache in (ref, tier)]
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_long_swaps_round_trip_through_direct_copies_or_a_gather(interleaved):
    """A sequence filled at once occupies consecutive device pages and gets consecutive host pages: the swap
    copies whole runs between the tiers (no gather kernel competing with decode). Two sequences grown a page
    at a time in turns interleave their device pages: the swap gathers them. Both round trip bit-exactly."""
    kv, dtype, page = "int4", "float32", 8
    n_pages = 2 * 16  # twice MIN_DIRECT_RUN
    cache, c = make(kv, dtype, page, host_tokens=2 * n_pages * page, max_tokens=3 * n_pages * page)
    gen = torch.Generator().manual_seed(5)
    if interleaved:
        seqs = {"a": [], "b": []}
        for sid in seqs:
            cache.add(sid)
        for _ in range(n_pages):
            for sid in seqs:
                cache.plan_step([sid], [page])
                for layer in range(LAYERS):
                    cache.prefill(layer, rand(gen, page, HQ, D, dtype=c.dtype), rand(gen, page, H, D, dtype=c.dtype),
                                  rand(gen, page, H, D, dtype=c.dtype), [sid])
    else:
        prefill([cache], {"a": list(range(n_pages * page))}, gen, c.dtype)
    bm = cache.block_manager
    pages, before = raw_pages(cache, "a"), cache.read_kv(1, "a")
    table = bm.block_table("a")
    assert (table == list(range(table[0], table[0] + len(table)))) != interleaved
    plan = bm.swap_out(["a"])  # the manager's decision only, to see how the tier would copy it ...
    (pool, idx, rs), = cache.host_tier._groups(plan.to_host, 2)
    assert (idx is None) != interleaved and len(rs) == 1  # direct: one run on both sides; else one host run
    cache.host_tier.run(plan)  # ... then run it as cache.swap_out does
    cache.wait_host_tier()
    assert same_raw(raw_pages(cache, "a"), pages)
    cache.swap_in(["a"])
    cache.wait_host_tier()
    assert same_raw(raw_pages(cache, "a"), pages)
    assert all(torch.equal(x, y) for x, y in zip(cache.read_kv(1, "a"), before))


def test_layer_zero_staged_ahead_is_not_reused_once_the_host_pages_changed():
    """The last layer stages the next step's layer 0 ahead. If host pages are freed and handed out again
    before that step (same host ids, same ring runs, other data), the staged copy is stale and must not be
    used: the next step still equals all-device decode."""
    kv, dtype, page = "fp16", "float16", 8
    ref, _ = make(kv, dtype, page)
    tier, _ = make(kv, dtype, page, host_tokens=16 * page, staging_tokens=8 * page)
    gen = torch.Generator().manual_seed(6)
    prefill([ref, tier], {"a": list(range(6 * page + 1)), "b": list(range(50, 50 + 6 * page + 1))}, gen, ref.dtype)

    def decode_equal(sid: str):
        steps = [cache.plan_step([sid], 1) for cache in (ref, tier)]
        for layer in range(LAYERS):
            q, k, v = (rand(gen, 1, n, D, dtype=ref.dtype) for n in (HQ, H, H))
            outs = [cache.decode(layer, q, [sid], k, v) for cache in (ref, tier)]
            assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), (sid, layer)
        return steps[1].cold

    tier.make_cold("a", 5)
    first = decode_equal("a")  # its last layer stages layer 0 of a next step like it
    tier.swap_in(["a"])
    tier.make_cold("b", 5)  # the same host ids (and ring runs) now hold b's pages
    tier.wait_host_tier()
    assert not tier.host_tier.holds(0, first.runs)  # the ring's copy of a's layer 0 is forgotten
    second = tier.plan_step(["b"], 0)
    assert second.cold.runs == first.runs  # ... though b's cold pages have the same host ids and ring runs
    tier.step = None
    decode_equal("b")


def test_cold_entries_are_ordered_by_host_id_in_runs_of_consecutive_ids():
    """build_step's tensor-op ordering of a step's cold entries against the plain definition (sorted tuples)."""
    import random

    from kvgen.runtime.host_tier import runs
    from kvgen.runtime.step import _cold_order

    for trial in range(200):
        rng = random.Random(trial)
        B, max_pages = rng.randint(1, 6), rng.randint(1, 12)
        if trial % 3:  # any ids
            ids = rng.sample(range(200), B * max_pages)
        else:  # long consecutive runs, as a fresh host pool hands out
            start = rng.randint(0, 50)
            ids = list(range(start, start + B * max_pages))
        tables = [ids[b * max_pages:(b + 1) * max_pages] for b in range(B)]
        host_pages = [rng.randint(0, max_pages) for _ in range(B)]
        host_pages[0] = max(host_pages[0], 1)
        entries = sorted((tables[b][i], b * max_pages + i) for b in range(B) for i in range(host_pages[b]))
        got_runs, got_at = _cold_order(tables, host_pages, max_pages)
        assert got_runs == runs([(h, pos) for pos, (h, _) in enumerate(entries)]), trial
        assert list(got_at) == [a for _, a in entries], trial


def test_two_spills_onto_one_host_page_restore_the_page_registered_there():
    """With one free host page, one allocation evicting two device prefix pages spills both onto it (the
    second evicts the first from the host's cache and is registered there): the copies must run in plan
    order, so a later prefix hit restores the KV registered under that hash. (Found in review: the copies
    were sorted by device id, and the restored prefix held the other page's KV.)"""
    kv, dtype, page = "fp32", "float32", 8
    cache, c = make(kv, dtype, page, host_tokens=2 * page, max_tokens=8 * page)
    bm = cache.block_manager
    gen = torch.Generator().manual_seed(3)
    prefill([cache], {"z": list(range(500, 500 + page + 1))}, gen, c.dtype)
    cache.make_cold("z", 1)  # one of the two host pages used: exactly one free
    prompt = list(range(2 * page + 1))
    prefill([cache], {"a": prompt}, gen, c.dtype)  # two full pages enter the device prefix cache
    original = [cache.read_kv(layer, "a") for layer in range(LAYERS)]
    cache.free("a")
    filler = [1000 + i for i in range(bm.num_free_pages(COMPRESSED) * page)]
    prefill([cache], {"x": filler}, gen, c.dtype)  # evicts both cached pages: two spills, one host page
    cache.free("x")
    hit = cache.add("b", prompt)
    assert hit > 0
    for layer in range(LAYERS):
        k, v = cache.read_kv(layer, "b")
        assert torch.equal(k, original[layer][0][:, :hit]) and torch.equal(v, original[layer][1][:, :hit])


def test_a_swap_in_between_planning_and_running_a_converting_step_makes_it_stale():
    """plan_step releases the residual pages its conversions read (they return to the free list) though its
    layers read them later; a swap_in before the layers ran may take them and write another sequence's KV
    there. Such a step can no longer run (a clear error, not a silently wrong compressed page), and the
    swapped-in sequence's KV is intact."""
    kv, dtype, page = "int2:residual=16", "float32", 16
    cache, c = make(kv, dtype, page, host_tokens=16 * page)
    gen = torch.Generator().manual_seed(5)
    prefill([cache], {"a": list(range(3 * page - 1)), "c": list(range(300, 300 + page + 3))}, gen, c.dtype)
    c_kv = [cache.read_kv(layer, "c") for layer in range(LAYERS)]
    cache.swap_out(["c"])
    step = cache.plan_step(["a"], [1])
    assert step.num_conversions > 0
    cache.swap_in(["c"])
    q, k, v = rand(gen, 1, HQ, D, dtype=c.dtype), rand(gen, 1, H, D, dtype=c.dtype), rand(gen, 1, H, D, dtype=c.dtype)
    with pytest.raises(KvgenRuntimeError, match="swapped in after this step was planned"):
        cache.decode(0, q, ["a"], k, v)
    cache.wait_host_tier()
    for layer in range(LAYERS):
        assert all(torch.equal(x, y) for x, y in zip(cache.read_kv(layer, "c"), c_kv[layer]))
