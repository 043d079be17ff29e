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
