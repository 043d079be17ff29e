"""BlockManager unit tests: page accounting, copy-on-write, prefix cache, LRU, atomic OutOfPages, errors.

The random state machines over the same books are in test_block_manager.py.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from pathlib import Path

import pytest

from kvgen.runtime.block_manager import COMPRESSED, RESIDUAL, AppendPlan, BlockManager, page_hash
from kvgen.runtime.errors import KvgenRuntimeError, OutOfPages, UnknownSequence


def test_fresh_pool_allocates_in_order_and_slots_are_page_times_size_plus_offset():
    bm = BlockManager(4, 8, 0, None)
    bm.add_sequence("a")
    plan = bm.append("a", 6)
    assert plan.slots == [0, 1, 2, 3, 4, 5]
    assert bm.block_table("a") == [0, 1]
    assert bm.num_compressed("a") == 2 and bm.seq_len("a") == 6
    assert bm.num_free_pages(COMPRESSED) == 6
    assert bm.append("a", 0) == AppendPlan([], [], [], COMPRESSED)


def test_copy_on_write_no_residual():
    bm = BlockManager(4, 8, 0, None)
    bm.add_sequence("a")
    bm.append("a", 6)                      # pages [0, 1], page 1 half full
    bm.fork("a", "b")
    assert bm.ref_count(COMPRESSED, 0) == 2 and bm.ref_count(COMPRESSED, 1) == 2
    plan = bm.append("b", 1)
    assert plan.copies == [(COMPRESSED, 1, 2)]
    assert plan.slots == [2 * 4 + 2]
    assert bm.block_table("b") == [0, 2] and bm.block_table("a") == [0, 1]
    assert bm.ref_count(COMPRESSED, 1) == 1 and bm.ref_count(COMPRESSED, 0) == 2
    plan = bm.append("a", 1)               # a is now the only owner of page 1: no copy
    assert plan.copies == [] and plan.slots == [1 * 4 + 2]


def test_fork_at_page_boundary_needs_no_copy():
    bm = BlockManager(2, 8, 0, None)
    bm.add_sequence("a")
    bm.append("a", 4)
    bm.fork("a", "b")
    plan = bm.append("b", 1)
    assert plan.copies == [] and bm.block_table("b") == [0, 1, 2]


def test_copy_on_write_residual_pool():
    bm = BlockManager(4, 8, 4, 0)
    bm.add_sequence("a")
    plan = bm.append("a", 2)
    assert plan.write_pool == RESIDUAL and plan.slots == [0, 1]
    bm.fork("a", "b")
    plan = bm.append("b", 2)               # fills the shared residual page: copy, then convert
    assert plan.copies == [(RESIDUAL, 0, 1)]
    assert plan.slots == [6, 7]
    assert plan.conversions == [(1, 0)]
    assert bm.block_table("b") == [0] and bm.num_compressed("b") == 1
    assert bm.ref_count(RESIDUAL, 1) == 0 and bm.ref_count(RESIDUAL, 0) == 1
    assert bm.num_free_pages(RESIDUAL) == 3


def test_residual_window_conversions():
    bm = BlockManager(2, 8, 8, 4)          # two full pages stay residual
    bm.add_sequence("a")
    plan = bm.append("a", 5)               # pages 0, 1 full + tail: nothing to convert yet
    assert plan.conversions == [] and bm.num_compressed("a") == 0
    plan = bm.append("a", 1)               # 6 tokens: 3 full pages, the oldest leaves the window
    assert plan.conversions == [(0, 0)]
    assert bm.num_compressed("a") == 1
    assert bm.block_table("a") == [0, 1, 2]  # compressed 0, then residual 1, 2
    assert bm.ref_count(RESIDUAL, 0) == 0 and bm.ref_count(COMPRESSED, 0) == 1
    plan = bm.append("a", 5)               # 11 tokens: 5 full pages, 3 compressed
    assert [src for src, _ in plan.conversions] == [1, 2]
    assert bm.num_compressed("a") == 3


def test_prefix_hit_counts_whole_pages():
    bm = BlockManager(4, 16, 0, None, "int8")
    bm.add_sequence("a", list(range(10)))
    bm.append("a", 10, list(range(10)))    # pages [0..3], [4..7] full and cached
    assert bm.add_sequence("b", list(range(8)) + [99, 98]) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.ref_count(COMPRESSED, bm.block_table("a")[0]) == 2
    assert bm.add_sequence("c", [0, 1, 2, 3, 7, 7, 7, 7]) == 4
    assert bm.add_sequence("d", [1, 2, 3, 4]) == 0
    assert bm.add_sequence("e", [0, 1, 2]) == 0  # no full page
    assert bm.add_sequence("f", list(range(8))) == 8  # whole prompt may hit
    assert bm.seq_len("f") == 8 and bm.num_compressed("f") == 2


def test_prefix_cache_is_per_scheme_and_needs_token_ids():
    bm = BlockManager(2, 8, 0, None, "int8")
    bm.add_sequence("a")
    bm.append("a", 4)                      # no token ids: never cached
    assert bm.add_sequence("b", [0, 1, 2, 3]) == 0
    bm.append("b", 4, [0, 1, 2, 3])
    bm.append("b", 2)                      # ids dropped: this and later pages never cached
    bm.append("b", 2, [6, 6])
    assert bm.add_sequence("c", [0, 1, 2, 3, 5, 5]) == 4
    assert bm.add_sequence("c2", [0, 1, 2, 3, 5, 5, 6, 6]) == 4
    assert page_hash(None, [0, 1], "int8") != page_hash(None, [0, 1], "fp8")
    other = BlockManager(2, 8, 0, None, "fp8")
    assert other.add_sequence("x", [0, 1]) == 0


def test_prefix_hit_residual_scheme_only_final_compressed_pages():
    bm = BlockManager(2, 8, 8, 4, "kivi")  # R = 2 pages
    toks = [1, 2, 3, 4, 5, 6, 7, 8]        # 4 full pages: 2 compressed, 2 residual
    bm.add_sequence("a", toks)
    bm.append("a", 8, toks)
    assert bm.num_compressed("a") == 2
    assert bm.add_sequence("b", toks) == 4             # only the 2 compressed pages
    assert bm.block_table("b") == bm.block_table("a")[:2] and bm.num_compressed("b") == 2
    assert bm.add_sequence("c", toks[:6]) == 2         # 3 full pages: 1 would be compressed
    assert bm.num_compressed("c") == 1 and bm.compressed_pages(2) == 0
    assert bm.add_sequence("d", toks[:4]) == 0         # both pages would stay residual
    plan = bm.append("b", 4, toks[4:])                  # the rest of the prompt: no conversion yet
    assert plan.conversions == [] and bm.num_compressed("b") == bm.compressed_pages(8) == 2


def test_conversion_reuses_an_already_cached_compressed_page():
    bm = BlockManager(2, 8, 8, 0, "kivi")
    bm.add_sequence("a")
    plan = bm.append("a", 2, [7, 8])
    assert plan.conversions == [(0, 0)]
    bm.add_sequence("b")
    plan = bm.append("b", 2, [7, 8])       # same prefix: share compressed page 0, no quantize
    assert plan.conversions == [] and plan.slots == [0, 1]
    assert bm.block_table("b") == [0] and bm.ref_count(COMPRESSED, 0) == 2
    assert bm.num_free_pages(RESIDUAL) == 8


def test_conversion_reusing_an_evictable_page_does_not_count_it_as_free():
    bm = BlockManager(2, 2, 8, 0, "kivi")
    bm.add_sequence("a")
    bm.append("a", 2, [7, 8])              # compressed page 0, cached
    bm.free("a")                           # page 0 evictable
    bm.add_sequence("x")
    bm.append("x", 2)                      # compressed page 1, not cached: pool now full
    bm.add_sequence("b")
    before = copy.deepcopy(vars(bm))
    assert not bm.can_append("b", 4, [7, 8, 1, 1])
    with pytest.raises(OutOfPages, match="compressed"):
        bm.append("b", 4, [7, 8, 1, 1])    # page 0 would be reused, so nothing is left to evict
    assert vars(bm) == before
    bm.free("x")
    plan = bm.append("b", 4, [7, 8, 1, 1])
    assert [dst for _, dst in plan.conversions] == [1] and bm.block_table("b") == [0, 1]


def test_lru_eviction_order_and_revival():
    bm = BlockManager(2, 4, 0, None)
    bm.add_sequence("a", [1, 2, 3, 4])
    bm.append("a", 4, [1, 2, 3, 4])        # pages 0 ([1,2]) and 1 ([3,4]) cached
    bm.add_sequence("x", [9, 9])
    bm.append("x", 2, [9, 9])              # page 2 cached
    bm.free("a")                           # tail first: LRU = [1, 0]
    bm.free("x")                           # LRU = [1, 0, 2]
    assert list(bm._lru) == [1, 0, 2]
    assert bm.num_free_pages(COMPRESSED) == 4
    bm.add_sequence("b")
    bm.append("b", 2)                      # takes the free page 3, evicts nothing
    assert bm.block_table("b") == [3] and list(bm._lru) == [1, 0, 2]
    bm.append("b", 2)                      # free list empty: evicts page 1 ([3,4]) first
    assert bm.block_table("b") == [3, 1] and list(bm._lru) == [0, 2]
    assert bm.add_sequence("c", [1, 2, 3, 4]) == 2   # [1,2] still cached, [3,4] gone
    assert list(bm._lru) == [2] and bm.ref_count(COMPRESSED, 0) == 1  # revived
    bm.append("b", 1)                      # evicts page 2 ([9,9])
    assert bm.block_table("b") == [3, 1, 2]
    assert bm.add_sequence("d", [9, 9]) == 0


def test_out_of_pages_is_atomic():
    bm = BlockManager(2, 3, 0, None)
    bm.add_sequence("a", [1, 2])
    bm.append("a", 2, [1, 2])
    bm.free("a")                           # page 0 is cached and evictable
    bm.add_sequence("b")
    bm.append("b", 3)                      # free pages 1 and 2; page 0 stays cached
    before = copy.deepcopy(vars(bm))
    assert not bm.can_append("b", 4)
    with pytest.raises(OutOfPages, match="compressed pool is out of pages"):
        bm.append("b", 4)                  # needs 2 pages, only the cached page 0 is evictable
    assert vars(bm) == before
    assert bm.add_sequence("c", [1, 2]) == 2  # the cached page was not evicted


def test_out_of_pages_residual_and_compressed_are_atomic():
    bm = BlockManager(2, 1, 2, 0)
    bm.add_sequence("a")
    bm.append("a", 2)                      # converted into compressed page 0
    before = copy.deepcopy(vars(bm))
    with pytest.raises(OutOfPages, match="residual"):
        bm.append("a", 6)                  # needs 3 residual pages
    assert vars(bm) == before
    with pytest.raises(OutOfPages, match="compressed"):
        bm.append("a", 2)                  # residual fits, but conversion needs a compressed page
    assert vars(bm) == before


def test_errors():
    bm = BlockManager(2, 4, 0, None)
    bm.add_sequence("a")
    with pytest.raises(KvgenRuntimeError, match="already exists"):
        bm.add_sequence("a")
    with pytest.raises(UnknownSequence):
        bm.append("nope", 1)
    with pytest.raises(UnknownSequence):
        bm.free("nope")
    with pytest.raises(KvgenRuntimeError, match="token ids"):
        bm.append("a", 2, [1])
    with pytest.raises(KvgenRuntimeError):
        bm.append("a", -1)
    with pytest.raises(KvgenRuntimeError, match="already exists"):
        bm.fork("a", "a")
    with pytest.raises(KvgenRuntimeError, match="unknown pool"):
        bm.num_free_pages("gpu")
    with pytest.raises(KvgenRuntimeError):
        bm.ref_count(COMPRESSED, 4)
    with pytest.raises(KvgenRuntimeError):
        BlockManager(0, 4, 0, None)
    with pytest.raises(KvgenRuntimeError):
        BlockManager(2, 4, 0, -2)
    assert issubclass(OutOfPages, KvgenRuntimeError) and issubclass(UnknownSequence, KvgenRuntimeError)
    bm.free("a")
    with pytest.raises(UnknownSequence):
        bm.seq_len("a")


def test_page_hash_is_a_sha256_chain():
    first = hashlib.sha256(repr((None, (1, 2), "s")).encode()).hexdigest()
    assert page_hash(None, [1, 2], "s") == first
    assert page_hash(first, (3, 4), "s") == hashlib.sha256(repr((first, (3, 4), "s")).encode()).hexdigest()


def test_two_managers_make_identical_decisions():
    def script(bm: BlockManager) -> list:
        out = []
        for i in range(6):
            out.append(bm.add_sequence(i, [i % 2] * 4))
            out.append(bm.append(i, 5, [i % 2] * 5))
            if i % 3 == 2:
                bm.fork(i, f"f{i}")
                out.append(bm.append(f"f{i}", 3, [1, 1, 1]))
                bm.free(i - 1)
        return out + [bm.block_table(s) for s in bm.sequences()]

    assert script(BlockManager(2, 40, 20, 2, "k")) == script(BlockManager(2, 40, 20, 2, "k"))


def test_runtime_imports_nothing_from_kvgen():
    runtime = Path(__file__).resolve().parents[1] / "kvgen" / "runtime"
    for name in ("block_manager.py", "reservation.py", "errors.py"):
        tree = ast.parse((runtime / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level > 0 or not (node.module or "").startswith("kvgen"), name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvgen") for a in node.names), name


