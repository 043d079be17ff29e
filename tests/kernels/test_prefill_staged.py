"""Staged prefill (config ``staged``): the pages a step can see dequantized once into a compute-dtype buffer.

Every quantized scheme (``hz.scheme_matrix``, the ones whose pages are not
plain compute-dtype pages) runs the same ragged batches through the staged
launch and the in-place one: both must match the float64 reference within
the scheme's tolerance and each other to rounding (they attend the same
compute-dtype values; only the order of the fp32 accumulation can differ).
Pools and outputs start poisoned (NaN): a staged page that was not written,
or a page staged from the wrong pool (compressed vs residual) or the wrong
block-table entry, fails. Cases: page-boundary prefixes and fresh chunks
(k_new/v_new), keys only from the pages, a sliding window (pages before it
are not staged), several query blocks per sequence, a sequence with no new
token, and the per-launch rule (``staged`` 2).
"""

from __future__ import annotations

import pytest
import torch

from . import harness as hz
from .test_prefill_matrix import _boundary_batch, _long_lengths, _one_case, prepare_prefill, small_tiles

QUANTIZED = [p for p in hz.scheme_matrix() if hz.get_scheme(p.values[0]).residual_tokens is not None
             or p.values[0] not in ("fp32", "fp16", "bf16")]


def _module(case):
    return hz.cache_and_kernel("prefill", case, [1], seed=0)[1]


@pytest.fixture(autouse=True)
def nan_staging_buffers(monkeypatch):
    """Every staging buffer starts as NaN: a key read from a page the stage kernel skipped poisons the output.

    Patched on every prefill module loaded during the test (the modules are generated per spec).
    """
    from kvgen.codegen import loader

    original = loader.load_kernel

    def poisoned(shape, dtype, device):
        k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        return k, k.clone()

    def load_kernel(*args, **kwargs):
        mod = original(*args, **kwargs)
        if hasattr(mod, "_stage_buffers"):
            monkeypatch.setattr(mod, "_stage_buffers", poisoned)
            monkeypatch.setattr(mod, "_no_stage_buffers", lambda dtype, device: poisoned(
                (1, mod.NUM_KV_HEADS, mod.PAGE, mod.HEAD_DIM), dtype, device))
        return mod
    monkeypatch.setattr(loader, "load_kernel", load_kernel)
    monkeypatch.setattr(hz, "load_kernel", load_kernel, raising=False)


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("kv", ["pages", "fresh"])
def test_staged_equals_in_place_and_reference(scheme, kv):
    case = _one_case(scheme, head_dim=64, gqa=2, num_kv_heads=2)
    assert _module(case).STAGEABLE
    lengths = _long_lengths(case)
    qlens = [lengths[0], 0, min(2 * case.page_size + 1, lengths[2]), 5]
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=31, fresh=kv == "fresh")
    ref = reference_fn()
    cfg = small_tiles(case)
    staged, in_place = launch(dict(cfg, staged=1)), launch(dict(cfg, staged=0))
    hz.check(case, staged, ref, f"staged, kv from {kv}")
    hz.check(case, in_place, ref, f"in place, kv from {kv}")
    assert hz.rel_l2(staged, in_place) <= 1e-3, "staged and in-place attend different values"


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_staged_fresh_chunks_at_page_boundaries(scheme):
    case = _one_case(scheme, gqa=4, num_kv_heads=1)
    lengths, qlens = _boundary_batch(case)
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=37, fresh=True)
    hz.check(case, launch(dict(small_tiles(case), staged=1)), reference_fn(), "staged fresh chunks at boundaries")


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("kv", ["pages", "fresh"])
def test_staged_sliding_window(scheme, kv):
    """Pages wholly before the window are never staged (they stay NaN in the buffer) and never read.

    The first chunk's earliest visible key (first_pos - window + 1) is the last slot of a page, the
    alignment where a stage range off by one token drops a page.
    """
    case = _one_case(scheme, gqa=2, num_kv_heads=1)
    P = case.page_size
    window = 2 * P + 3
    lengths = _long_lengths(case)
    qlens = [lengths[0] - (3 * P - 1 + window - 1), 1, lengths[2], 4]  # first_pos 3P - 1 + window - 1
    assert qlens[0] > 0 and (lengths[0] - qlens[0] - window + 1) % P == P - 1
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=41, window=window, fresh=kv == "fresh")
    hz.check(case, launch(dict(small_tiles(case), staged=1)), reference_fn(window=window), f"staged window, {kv}")


def test_step_config_stages_long_chunks_over_a_prefix_only():
    """``staged`` 2 resolved per step and per sequence from the lengths; other configs pass through unchanged."""
    scheme = QUANTIZED[0].values[0]
    mod = _module(_one_case(scheme, gqa=2, num_kv_heads=1))
    cfg = {"block_m": 16, "pages_per_tile": 2, "num_warps": 4, "num_stages": 1, "staged": 2}
    chunk_over_prefix = mod.step_config(cfg, [512], [2048], True)
    assert chunk_over_prefix == dict(cfg, staged=1, stage_rows=(0,))
    # a first chunk (no prefix) stages nothing: the staged kernel attends its fresh keys alone
    assert mod.step_config(cfg, [2048], [2048], True) == dict(cfg, staged=1, stage_rows=(), fresh_rows=(0,))
    assert mod.step_config(cfg, [2048], [2048], False) == dict(cfg, staged=1, stage_rows=(0,))  # it reads itself
    assert mod.step_config(cfg, [16], [16], True) == mod.in_place_config(cfg)  # ... one query block: in place
    # decode rows (one query block each) beside a long first chunk: only the chunk runs the staged kernel
    assert mod.step_config(cfg, [2048] + [1] * 63, [2048] + [1024] * 63, True) == dict(
        cfg, staged=1, stage_rows=(), fresh_rows=(0,))
    assert mod.step_config(cfg, [1, 2048, 512], [1024, 2048, 4096], True) == dict(
        cfg, staged=1, stage_rows=(2,), fresh_rows=(1,))
    # a chunk over a prefix beside 63 decode rows of 1K: only the chunk is staged, however short, as long
    # as its query blocks read the prefix at least 1 + STAGE_MIN_REUSE times
    assert mod.step_config(cfg, [1] * 63 + [1024], [1024] * 63 + [4096], True)["stage_rows"] == (63,)
    assert mod.step_config(cfg, [256] + [1] * 63, [4096] + [1024] * 63, True)["stage_rows"] == (0,)
    assert mod.step_config(cfg, [32] + [1] * 3, [4096] + [1024] * 3, True)["staged"] == 0  # 2 blocks: in place
    # several chunks: the one re-read most is first (a cut to the buffer's limit keeps it)
    assert mod.step_config(cfg, [64, 1, 512, 128], [1024, 64, 4096, 2048], True)["stage_rows"] == (2, 3, 0)
    assert mod.step_config(cfg, [0, 0], [64, 64], True)["staged"] == 0  # nothing to attend
    for other in (dict(cfg, staged=0), dict(cfg, staged=1), None, {}):
        assert mod.step_config(other, [512], [2048], True) == other


def test_staged_auto_rule_and_bad_values():
    """Without step facts ``staged`` 2 stages a long chunk's launch, not a decode-like one; the buffer's
    limit keeps the first rows that fit; bad values are refused."""
    scheme = QUANTIZED[0].values[0]
    case = _one_case(scheme, gqa=2, num_kv_heads=1)
    mod = _module(case)
    q_long = torch.empty(4 * 128, 2, case.head_dim, dtype=case.dtype)
    q_decode = torch.empty(4, 2, case.head_dim, dtype=case.dtype)
    assert mod._stage_rows({"staged": 2}, q_long, 4, 8, 32) == (0, 1, 2, 3)
    assert mod._stage_rows({"staged": 2}, q_decode, 4, 8, 32) == ()
    assert mod._stage_rows({"staged": 1}, q_decode, 4, 8, 32) == (0, 1, 2, 3)
    assert mod._stage_rows({"staged": 0}, q_long, 4, 8, 32) == ()
    assert mod._stage_rows({"staged": 1, "stage_rows": [2, 0]}, q_long, 4, 8, 32) == (2, 0)
    slot = 2 * case.page_size * case.head_dim * q_long.element_size()  # K and V of one page, one head
    pages = mod.STAGE_MAX_BYTES // slot // 2 - 1  # two sequences' slots fit, three do not
    assert mod._stage_rows({"staged": 1, "stage_rows": [3, 1, 0]}, q_long, 4, pages, 32) == (3, 1)
    assert mod._stage_rows({"staged": 1}, q_long, 4, mod.STAGE_MAX_BYTES // slot + 1, 32) == ()
    for bad in ({"staged": 3}, {"staged": 1, "stage_rows": [4]}, {"staged": 1, "stage_rows": [1, 1]}):
        with pytest.raises(ValueError, match="staged|stage_rows"):
            mod._stage_rows(bad, q_long, 4, 8, 32)
    n = 3 * case.page_size + 1
    launch, reference_fn = prepare_prefill(case, [n] * 2, [n] * 2, seed=43)
    hz.check(case, launch(dict(small_tiles(case), staged=2)), reference_fn(), "staged 2")


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("kv", ["pages", "fresh"])
def test_staging_some_sequences_reads_the_others_in_place(scheme, kv, monkeypatch):
    """A step that stages some sequences (step_config's ``stage_rows``, or the buffer's limit cutting them)
    runs the staged kernel for those and the in-place kernel for the rest: every row right, each written by
    exactly one of them (outputs and staging buffers start as NaN; a row neither kernel writes stays NaN)."""
    case = _one_case(scheme, gqa=2, num_kv_heads=1)
    mod = _module(case)
    lengths = _long_lengths(case)
    qlens = [lengths[0], 1, min(2 * case.page_size + 1, lengths[2]), 0]
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=53, fresh=kv == "fresh")
    ref = reference_fn()
    cfg = small_tiles(case)
    stage_calls = []
    original = mod._stage_rows
    monkeypatch.setattr(mod, "_stage_rows", lambda *a: stage_calls.append(original(*a)) or stage_calls[-1])
    poison_staged_pages_before_the_in_place_launch(mod, monkeypatch)
    for rows in ([2], [0], [2, 0], [1, 3]):
        hz.check(case, launch(dict(cfg, staged=1, stage_rows=rows)), ref, f"staged rows {rows}, kv {kv}")
    # the buffer's limit: room for one sequence's slot, so only the first row is staged
    max_pages = max(-(-n // case.page_size) for n in lengths)  # the block table's width
    slot = 2 * max_pages * case.page_size * case.head_dim * torch.empty((), dtype=case.dtype).element_size()
    monkeypatch.setattr(mod, "STAGE_MAX_BYTES", slot + slot // 2)
    hz.check(case, launch(dict(cfg, staged=1, stage_rows=[2, 0])), ref, f"staging cut to one row, kv {kv}")
    assert stage_calls == [(2,), (0,), (2, 0), (1, 3), (2,)]


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_fresh_rows_attend_their_fresh_keys_alone(scheme, monkeypatch):
    """``fresh_rows`` (first chunks, no cached page) run the staged kernel with no staging and no buffer slot,
    beside staged rows or alone; the others are read in place. The stand-in buffer, the chunks' own pages and
    the outputs start as NaN: a fresh row that read a page or a row no kernel wrote comes out NaN."""
    case = _one_case(scheme, gqa=2, num_kv_heads=1)
    mod = _module(case)
    P = case.page_size
    lengths = [3 * P + 5, 2 * P + 7, 5 * P, P + 1]
    qlens = [3 * P + 5, 1, 2 * P + 1, P + 1]  # rows 0 and 3 are first chunks (one ends a page past a page)
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=59, fresh=True)
    ref = reference_fn()
    cfg = dict(small_tiles(case), staged=2)
    step = mod.step_config(cfg, qlens, lengths, True)
    assert step["fresh_rows"] == (0, 3) and step["stage_rows"] == (2,)
    launches = count_launches(mod, monkeypatch)
    hz.check(case, launch(step), ref, "fresh rows beside a staged row and a decode row")
    assert launches == {"_stage_kernel": 1, "_prefill_staged_kernel": 1, "_prefill_kernel": 1}
    only_fresh = dict(cfg, staged=1, stage_rows=(), fresh_rows=(0, 3))
    launches.clear()
    hz.check(case, launch(only_fresh), ref, "fresh rows, the others in place")
    assert launches == {"_prefill_staged_kernel": 1, "_prefill_kernel": 1}  # nothing staged, no stage launch
    monkeypatch.setattr(mod, "STAGE_MAX_BYTES", 0)  # no room to stage row 2: in place, the fresh rows still not
    launches.clear()
    hz.check(case, launch(step), ref, "fresh rows, the staging cut to nothing")
    assert launches == {"_prefill_staged_kernel": 1, "_prefill_kernel": 1}
    for bad in ({"fresh_rows": (4,)}, {"fresh_rows": (0, 0)}, {"stage_rows": (2,), "fresh_rows": (2,)},
                {"stage_rows": None, "fresh_rows": (0,)}, {"staged": 0, "fresh_rows": (0,)}):
        with pytest.raises(ValueError, match="fresh_rows"):
            launch({**only_fresh, **bad})
    pages_only, _ = prepare_prefill(case, lengths, qlens, seed=59)
    with pytest.raises(ValueError, match="fresh keys"):
        pages_only(only_fresh)


def test_stage_maps_keep_the_in_place_map_aligned():
    """The in-place kernel's sequence map starts 16 bytes aligned for any count of staged rows (Triton compiles a
    variant per pointer alignment: warm-up's one-row staging would not cover a step staging none or two)."""
    mod = _module(_one_case(QUANTIZED[0].values[0], gqa=2, num_kv_heads=1))
    for rows, skip in (((), (3,)), ((0,), ()), ((0,), (2,)), ((1, 0), ()), ((4, 0, 2), (1,)), ((0, 1, 2, 3, 4), ())):
        seqs, slots = mod._stage_maps(rows, skip, 6, torch.device("cpu"))
        assert slots.data_ptr() % 16 == 0 and seqs.data_ptr() % 16 == 0
        assert seqs.tolist() == list(rows)
        assert slots.tolist() == [rows.index(b) if b in rows else len(rows) if b in skip else -1 for b in range(6)]


def count_launches(mod, monkeypatch) -> dict[str, int]:
    """Counts of the prefill module's kernel launches by name (a dict the test clears between launches)."""
    counts: dict[str, int] = {}
    for name in ("_stage_kernel", "_prefill_staged_kernel", "_prefill_kernel"):
        kernel = getattr(mod, name)

        class Counted:
            def __init__(self, name, kernel):
                self.name, self.kernel = name, kernel

            def __getitem__(self, grid):
                counts[self.name] = counts.get(self.name, 0) + 1
                return self.kernel[grid]
        monkeypatch.setattr(mod, name, Counted(name, kernel))
    return counts


def poison_staged_pages_before_the_in_place_launch(mod, monkeypatch):
    """The in-place launch beside a staged one finds the staged sequences' pages NaN (restored after it): a
    staged sequence it does not skip comes out NaN, so each row is written by exactly one of the kernels."""
    kernel, n = mod._prefill_kernel, len(mod.POOL_TENSORS)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                if not kwargs.get("SKIP_STAGED"):
                    return kernel[grid](*args, **kwargs)
                pools = dict(zip(mod.POOL_TENSORS, args[2:2 + n]))
                tables, seq_lens = args[2 + n], args[3 + n].tolist()
                num_compressed, slots = args[4 + n].tolist(), args[6 + n].tolist()
                saved = {name: t.clone() for name, t in pools.items() if t.is_floating_point()}
                poisoned = 0
                for b, slot in enumerate(slots):
                    pages = tables[b].tolist()[:-(-seq_lens[b] // mod.PAGE)] if slot >= 0 else []
                    for j, page in enumerate(pages):
                        for name in ("rk", "rv") if mod.RESIDUAL and j >= num_compressed[b] else mod.COMPRESSED_TENSORS:
                            if name in saved:
                                pools[name][page] = float("nan")
                                poisoned += 1
                assert poisoned or not any(s >= 0 and seq_lens[b] for b, s in enumerate(slots))
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    for name, t in saved.items():
                        pools[name].copy_(t)
            return run
    monkeypatch.setattr(mod, "_prefill_kernel", Spy())


def test_a_failed_staging_allocation_reads_in_place(monkeypatch):
    case = _one_case(QUANTIZED[0].values[0], gqa=2, num_kv_heads=1)
    lengths = _long_lengths(case)
    launch, reference_fn = prepare_prefill(case, lengths, lengths, seed=47)
    mod = _module(case)
    monkeypatch.setattr(mod, "_stage_buffers", lambda *a: None)
    hz.check(case, launch(dict(small_tiles(case), staged=1)), reference_fn(), "staging out of memory")


def test_float_schemes_never_stage():
    case = _one_case("fp32" if hz.on_cpu() else "bf16", gqa=2, num_kv_heads=1)
    mod = _module(case)
    assert not mod.STAGEABLE and not hasattr(mod, "_stage_kernel")
    assert mod._stage_rows({"staged": 1}, torch.empty(256, 2, case.head_dim), 2, 4, 16) == ()
