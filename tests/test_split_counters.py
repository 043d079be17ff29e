"""kvgen.runtime.split_counters: one zeroed buffer per owner and stream, grown (never freed), owners kept apart."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvgen.runtime import split_counters  # noqa: E402


def test_buffers_per_owner_grow_and_outgrown_ones_are_kept(monkeypatch):
    monkeypatch.setattr(split_counters, "_COUNTERS", {})
    monkeypatch.setattr(split_counters, "_RETIRED", [])
    cpu = torch.device("cpu")
    a = split_counters.arrival_counters(cpu, 10)
    assert a.dtype == torch.int32 and a.numel() >= 256 and not a.any()
    assert split_counters.arrival_counters(cpu, 200) is a  # reused while large enough
    other = split_counters.arrival_counters(cpu, 10, owner="small GEMM", minimum=1024)
    assert other is not a and other.numel() >= 1024  # owners never share counters
    grown = split_counters.arrival_counters(cpu, 1000)
    assert grown is not a and grown.numel() >= 1000 and not grown.any()
    assert split_counters._RETIRED == [a]  # a graph captured with the old one may still count there
    assert split_counters.buffers("decode") == [grown] and split_counters.buffers("small GEMM") == [other]


def test_owned_counters_cover_every_sequence_and_head():
    own = split_counters.owned_counters(3, 8, "cpu")
    assert own.shape == (24,) and own.dtype == torch.int32 and not own.any()
    assert split_counters.owned_counters(0, 8, "cpu").numel() == 8  # at least one sequence
