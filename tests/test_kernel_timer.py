"""The autotuner's timer (kvgen.runtime.kernel_timer) on a GPU: GPU time, not launch time."""

from __future__ import annotations

import pytest
import torch

import types

from kvgen.runtime import kernel_timer
from kvgen.runtime.kernel_timer import COLD_FACTOR, MAX_COLD_COPIES, cold_copies, do_bench_ms, graph_time_ms


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_graph_time_of_a_bandwidth_bound_kernel_matches_its_bytes():
    """A 1 GiB in-place scale moves 2 GiB: its graph time and do_bench's agree within 15% (both GPU-bound)."""
    _cuda()
    x = torch.randn(2**28, device="cuda")  # 1 GiB of fp32
    g = graph_time_ms(lambda: x.mul_(1.0000001))
    d = do_bench_ms(lambda: x.mul_(1.0000001))
    assert 0.85 < g / d < 1.15, (g, d)
    assert 2 * x.numel() * 4 / (g * 1e-3) < 6e12  # no faster than an H200's memory could be


@pytest.mark.gpu
def test_graph_time_of_a_tiny_kernel_is_below_its_launch():
    """A one-element add runs in a few microseconds; do_bench times its launch, graph time does not."""
    _cuda()
    x = torch.zeros(1, device="cuda")

    def many_small_launches():  # a launch that costs far more host time than GPU time
        for _ in range(20):
            x.add_(1.0)
    g = graph_time_ms(many_small_launches)
    d = do_bench_ms(many_small_launches)
    assert g < d, (g, d)
    before = x.item()
    many_small_launches()
    assert x.item() == before + 20  # the stream still works after the capture


@pytest.mark.gpu
def test_a_call_that_cannot_be_captured_is_timed_the_old_way():
    """A host synchronization inside fn breaks capture: the timer falls back to do_bench and CUDA stays usable."""
    _cuda()
    x = torch.ones(1024, device="cuda")
    before = torch.cuda.current_stream()
    ms = graph_time_ms(lambda: x.sum().item())
    assert 0 < ms < 100
    assert torch.cuda.current_stream() == before  # the failed capture's stream is not left current
    assert torch.cuda.is_available() and x.sum().item() == 1024.0


def test_cold_copies_cover_a_few_l2_caches(monkeypatch):
    """Enough input sets that COLD_FACTOR L2s pass between two uses of one; none where there is no L2."""
    assert cold_copies(1 << 20, "cpu") == 1 and cold_copies(1 << 20, "meta") == 1
    monkeypatch.setattr(kernel_timer, "l2_bytes", lambda device: 50 << 20)
    assert cold_copies(50 << 20, "cuda") == COLD_FACTOR + 1  # the other COLD_FACTOR pass between two uses
    assert cold_copies(COLD_FACTOR * (50 << 20), "cuda") == 1  # cold by itself
    assert cold_copies(COLD_FACTOR * (50 << 20) - 1, "cuda") == 3  # one other set would fall a byte short
    assert cold_copies(7 << 20, "cuda") == -(-COLD_FACTOR * 50 // 7) + 1
    assert cold_copies(1, "cuda") == MAX_COLD_COPIES and cold_copies(0, "cuda") == 1


def _bench_cache(tmp_path, name):
    from .test_backend_choice import _kernels, _load, _plan, _tuner

    kernels, variants, _ = _kernels(name, [], 0.0)
    cache = _load(_plan(), kernels, variants, _tuner(tmp_path))
    cache.__dict__.pop("_bench_inputs", None)
    return cache


def _probe():
    """A decode module stand-in recording (q, pools, table, seq_lens) per launch."""
    seen = []
    probe = types.ModuleType("probe")
    probe.launch = lambda q, out, pools, bt, seq_lens, *rest, **kw: seen.append((q, pools, bt, seq_lens))
    return probe, seen


def test_the_runtime_bench_cycles_through_disjoint_cold_page_sets(tmp_path, monkeypatch):
    """KVCache._bench at one length (exact=True): successive calls read disjoint sets of random pages (one table
    per cold copy, in turn, in a scratch pool of the cache's layout: the cache's own pool may be too small to
    keep them apart); the same table comes back only after the others; every other input is shared, also with
    other configs."""
    from kvgen.runtime.pools import page_bytes

    cache = _bench_cache(tmp_path, "coldbench")
    B, S = 2, 1024
    pages = S // cache.page_size
    one_set = B * pages * page_bytes(cache.pools[0])
    monkeypatch.setattr(kernel_timer, "l2_bytes", lambda device: one_set)  # -> COLD_FACTOR + 1 tables
    n = COLD_FACTOR + 1
    probe, seen = _probe()
    fn = cache._bench("decode", (B, S), None, probe, exact=True)
    assert fn.cycle == n and fn.period == 1
    for _ in range(2 * n + 1):
        fn()
    tables = [bt for _, _, bt, _ in seen]
    assert len({id(t) for t in tables}) == n
    assert all(tables[i] is tables[i % n] for i in range(len(tables)))
    assert all(t.shape == (B, pages) for t in tables)
    assert len({id(lens) for *_, lens in seen}) == 1
    scratch = seen[0][1]
    assert all(p is scratch for _, p, _, _ in seen) and scratch is not cache.pools[0]
    assert set(scratch) == set(cache.pools[0]) and all(scratch[k].shape[0] == n * B * pages + 1 for k in scratch)
    assert len({id(q) for q, *_ in seen}) == 1
    # another config of the same bucket shares the inputs (a fair comparison), starting from the first table
    seen.clear()
    cache._bench("decode", (B, S), {"tile": 16}, probe, exact=True)()
    assert seen[0][2] is tables[0]


@pytest.mark.parametrize("l2_sets", [1.0, 0.5, 0.3, 0.05])
def test_decode_tuning_alternates_the_bucket_length_and_half_of_it(tmp_path, monkeypatch, l2_sets):
    """By default a decode bench alternates sequences of the bucket's length and of half of it: an even number
    of cold tables (one length each, sized for the mean read) or, where one table is cold by itself, both
    lengths on it; ``period`` 2 keeps both in a timing of long calls."""
    from kvgen.runtime.pools import page_bytes

    cache = _bench_cache(tmp_path, "spanbench")
    B, S = 2, 1024
    one_set = B * (S // cache.page_size) * page_bytes(cache.pools[0])
    monkeypatch.setattr(kernel_timer, "l2_bytes", lambda device: int(one_set * l2_sets))
    copies = kernel_timer.cold_copies(one_set * 3 // 4, "cuda")
    probe, seen = _probe()
    fn = cache._bench("decode", (B, S), None, probe)
    made = cache._bench_inputs[1]
    full, half = made["seq_lens"], made["half_lens"]
    assert full is not half and full.shape == half.shape == (B,)
    n = len(made["bts"])
    assert n == (copies + copies % 2 if copies > 1 else 1)
    assert fn.period == 2 and fn.cycle == (n if n > 1 else 2)
    for _ in range(3 * fn.cycle):
        fn()
    pairs = [(id(bt), lens is full) for _, _, bt, lens in seen]
    assert [lens for _, lens in pairs] == [i % 2 == 0 for i in range(len(pairs))]  # alternating from the full one
    if n > 1:  # each table always at the same length, and every table used
        assert len(set(pairs)) == n and len({t for t, _ in pairs}) == n
    else:
        assert len({t for t, _ in pairs}) == 1
    # the exact bench of the same bucket makes its own inputs (its tables are counted for whole reads)
    cache._bench("decode", (B, S), None, probe, exact=True)
    assert cache._bench_inputs[0][-1] is False


def test_a_scheme_with_more_than_a_tail_page_of_residual_is_timed_at_the_length_alone(tmp_path, monkeypatch):
    """int2 keeps 128 tokens in the compute dtype: a half-length sequence would split its pages between the pools
    otherwise than the bench's tables, so its decode is timed at the bucket's length alone."""
    cache = _bench_cache(tmp_path, "residualbench")
    monkeypatch.setattr(cache, "residual_tokens", 0)
    probe, seen = _probe()
    assert cache._bench("decode", (2, 1024), None, probe).period == 2  # a tail page only: both ends
    cache.__dict__.pop("_bench_inputs", None)
    monkeypatch.setattr(cache, "residual_tokens", 128)
    fn = cache._bench("decode", (2, 1024), None, probe)
    assert fn.period == 1
    for _ in range(fn.cycle):
        fn()
    assert seen and all(lens is cache._bench_inputs[1]["seq_lens"] for *_, lens in seen)


def _pool(pages: int, residual_pages: int = 0, D: int = 8, H: int = 2) -> dict:
    pool = {"k": torch.zeros(pages, H, 16, D // 2, dtype=torch.uint8), "v": torch.zeros(pages, H, 16, D // 2,
                                                                                      dtype=torch.uint8),
            "ks": torch.zeros(pages, H, 2, D, dtype=torch.float16)}
    if residual_pages:
        pool["rk"] = torch.zeros(residual_pages, H, 16, D, dtype=torch.float16)
        pool["rv"] = torch.zeros(residual_pages, H, 16, D, dtype=torch.float16)
    return pool


def test_cold_page_tables_are_disjoint_and_count_residual_pages_at_their_own_size(monkeypatch):
    """cold_page_tables: the working set weighs compressed and residual pages by their own bytes (a residual
    scheme's rk/rv rows are not part of every page); copies hold disjoint pages, compressed entries first; a
    call that reads no pages (a prefill with no cached prefix), or one of three L2s, keeps the caller's pool."""
    from kvgen.runtime.kernel_timer import cold_page_tables

    pool = _pool(64, 16)
    comp = 2 * (16 * 4 + 16 * 4) + 2 * 2 * 8 * 2  # bytes of one compressed page (2 heads), rk/rv excluded
    res = 2 * 2 * 16 * 8 * 2
    B, pages, nc = 2, 8, 6
    ws = B * (nc * comp + (pages - nc) * res)
    l2 = {"n": ws}
    monkeypatch.setattr(kernel_timer, "l2_bytes", lambda device: l2["n"])
    scratch, tables = cold_page_tables(pool, B, pages, nc)
    n = COLD_FACTOR + 1
    assert len(tables) == n and scratch is not pool
    assert scratch["k"].shape[0] == n * B * nc + 1 and scratch["rk"].shape[0] == n * B * (pages - nc) + 1
    comp_ids = torch.cat([t[:, :nc].flatten() for t in tables])
    res_ids = torch.cat([t[:, nc:].flatten() for t in tables])
    assert comp_ids.unique().numel() == comp_ids.numel() and res_ids.unique().numel() == res_ids.numel()
    assert int(comp_ids.max()) < scratch["k"].shape[0] and int(res_ids.max()) < scratch["rk"].shape[0]
    # one L2 three times over: cold by itself, on the caller's pool, distinct pages
    l2["n"] = ws // COLD_FACTOR
    same, (table,) = cold_page_tables(pool, B, pages, nc)
    assert same is pool and table[:, :nc].unique().numel() == B * nc
    # a prefill whose pages are all its own chunk (read_pages=0): nothing to keep cold
    l2["n"] = 10 * ws
    same, (table,) = cold_page_tables(pool, B, pages, nc, read_pages=0)
    assert same is pool and table.shape == (B, pages)
    # without a residual pool every entry is compressed
    scratch, tables = cold_page_tables(_pool(64), B, pages, nc)
    ids = torch.cat([t.flatten() for t in tables])
    assert set(scratch) == {"k", "v", "ks"} and scratch["k"].shape[0] == len(tables) * B * pages + 1
    assert ids.unique().numel() == ids.numel() == scratch["k"].shape[0] - 1 and tables[0].shape == (B, pages)
    # a prefill that reads 3 of its 8 pages: scratch rows for those only; the rest point at one spare page
    scratch, tables = cold_page_tables(_pool(64, 16), B, pages, nc, read_pages=3)
    spare = scratch["k"].shape[0] - 1
    assert spare == len(tables) * B * 3 and scratch["rk"].shape[0] == 1
    read = torch.cat([t[:, :3].flatten() for t in tables])
    assert read.unique().numel() == read.numel() and int(read.max()) < scratch["k"].shape[0]
    assert all(bool((t[:, 3:nc] == spare).all()) and bool((t[:, nc:] == 0).all()) for t in tables)


@pytest.mark.gpu
def test_the_graph_holds_whole_turns_of_a_cycle():
    """graph_time_ms captures a multiple of fn.cycle calls (each input set equally often)."""
    _cuda()
    x = torch.zeros(1, device="cuda")
    made = []

    def fn():
        made.append(1)
        x.add_(1.0)
    fn.cycle = 7
    graph_time_ms(fn)
    captured = len(made) - 3  # two warm-up calls and one timed call precede the capture
    assert captured >= 7 and captured % 7 == 0, captured


@pytest.mark.gpu
def test_cycled_inputs_time_a_small_read_cold():
    """The premise of cold_copies: a read that fits in L2 runs slower when cycled over cold copies than when
    repeated on one buffer (graph timer both times)."""
    _cuda()
    size = max(1 << 20, kernel_timer.l2_bytes("cuda") // 2)
    n = cold_copies(size, "cuda")
    bufs = [torch.randn(size // 4, device="cuda") for _ in range(n)]
    turn = iter(range(1 << 30))
    warm = graph_time_ms(lambda: bufs[0].sum())
    cold = graph_time_ms(lambda: bufs[next(turn) % n].sum())
    assert n > 1 and cold > 1.15 * warm, (n, warm, cold)


def test_a_sliding_window_plan_counts_only_the_window_s_pages(tmp_path, monkeypatch):
    """With a sliding window the kernels read only the window's pages: more copies keep them cold."""
    from kvgen.runtime.kernel_timer import cold_copies
    from kvgen.runtime.pools import page_bytes
    from .test_backend_choice import _kernels, _load, _plan, _tuner

    plan = _plan()
    plan["sliding_window"] = 64
    kernels, variants, _ = _kernels("coldwindow", [], 0.0)
    cache = _load(plan, kernels, variants, _tuner(tmp_path))
    cache.__dict__.pop("_bench_inputs", None)
    B, S, P = 2, 1024, cache.page_size
    one = page_bytes(cache.pools[0])
    monkeypatch.setattr(kernel_timer, "l2_bytes", lambda device: B * (S // P) * one)
    fn = cache._bench("decode", (B, S), None, types.SimpleNamespace(launch=lambda *a, **k: None), exact=True)
    assert fn.cycle == cold_copies(B * (-(-64 // P) + 1) * one, "cuda") > cold_copies(B * (S // P) * one, "cuda")


def test_a_timer_that_sat_idle_warms_its_graph_up_first():
    """Idle past WARM_GAP_S: enough untimed replays for WARM_MS (capped); right after another timing, or for a
    replay of WARM_MS or more (its median leaves a slow first replay out): none."""
    w = kernel_timer.warm_replays
    assert w(1.0, idle_s=kernel_timer.WARM_GAP_S / 2) == 0
    assert w(1.0, idle_s=float("inf")) == round(kernel_timer.WARM_MS)  # a fresh process counts as idle
    assert w(kernel_timer.WARM_MS, idle_s=10.0) == 0 and w(kernel_timer.WARM_MS * 3, idle_s=10.0) == 0
    assert w(1e-6, idle_s=10.0) == kernel_timer.MAX_WARM_REPLAYS
    assert w(kernel_timer.WARM_MS / 2.5, idle_s=10.0) == 3  # rounds up: at least WARM_MS
