"""benchmarks.run's ``--shapes``: anchor shapes picked by name, in the order named, and a clear refusal."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks.run import ANCHOR_SHAPES, anchor_shapes  # noqa: E402


def test_anchor_shapes_keep_the_order_named():
    picked = anchor_shapes("1x131072, 32x4096")
    assert picked == [s for s in ANCHOR_SHAPES if s[:2] == (1, 131072)] + [ANCHOR_SHAPES[0]]


@pytest.mark.parametrize("text", ["3x3", "", "32x4096,1x1", "32-4096"])
def test_unknown_shapes_are_refused_with_the_choices(text):
    with pytest.raises(SystemExit, match="1x131072"):
        anchor_shapes(text)


@pytest.mark.parametrize("scheme", ["int2", "int4", "int8"])
@pytest.mark.parametrize("B,L", [(1, 131072), (8, 32768), (16, 8192), (32, 4096)])
def test_harness_caches_hold_every_sequence(scheme, B, L):
    """The harness caches (benchmarks.cuda_decode.cache_tokens) leave room for B sequences of L tokens in both
    pools: a residual scheme's residual pool (tails and append slack) comes out of the same budget, and int2 at 8 x
    32768 ran out of compressed pages (53 short) before the slack was added."""
    from benchmarks.cuda_decode import anchor_plan, cache_tokens
    from benchmarks.run import PAGE
    from kvgen.registry import default_registry
    from kvgen.runtime.page_pool import pool_sizes

    schemes = default_registry().schemes
    plan = anchor_plan(scheme, B, L, 64, 8, 128)
    compressed, residual = pool_sizes(plan.to_json(), cache_tokens(B, L), B)
    assert compressed >= B * schemes[scheme].compressed_pages(L, PAGE)
    tail = -(-L // PAGE) - schemes[scheme].compressed_pages(L, PAGE)
    assert residual >= B * tail
