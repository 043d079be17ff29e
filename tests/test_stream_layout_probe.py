"""benchmarks.experiments.stream_layout (a GPU probe of DRAM throughput by page layout): on the interpreter, both
layouts read exactly the bytes the decode reads, in its page order (the checksum over every stream's words of every
(page, KV head) of each program matches torch's)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.experiments.stream_layout import GEOMETRIES, case  # noqa: E402


@pytest.mark.parametrize("layout", ["separate", "together"])
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_probe_reads_every_stream_of_every_page(name, layout):
    launch, check, nbytes = case(name, layout, 2, 48, 2, "cpu")
    launch(2, 4)
    assert check()
    assert nbytes == 2 * 3 * 2 * sum(GEOMETRIES[name])
