"""kvgen.engine.pdl: when the engine's kernels launch with programmatic dependent launch (the GPU side is
tests/engine/test_gpu.py::test_pdl_launches_give_the_tokens_of_plain_launches)."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine import fused, pdl


def test_pdl_is_off_the_gpu_whatever_the_switch(monkeypatch):
    x = torch.zeros(2, 8)
    for value in ("1", "0", ""):
        monkeypatch.setenv("KVGEN_PDL", value)
        assert pdl.enabled(x) is False
        assert fused._pdl(x) == {}  # the interpreter and torch paths never get Triton's launch_pdl


def test_the_switch_turns_pdl_off_before_looking_at_the_device(monkeypatch):
    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(pdl, "_hopper_or_newer", lambda index: True)
    fake = FakeCuda()
    fake.device = torch.device("cuda", 0)
    monkeypatch.setenv("KVGEN_PDL", "1")
    monkeypatch.setattr(pdl, "triton_interpret", lambda: True)
    assert pdl.enabled(fake) is False  # the interpreter's kernels take no launch_pdl
    monkeypatch.setattr(pdl, "triton_interpret", lambda: False)
    assert pdl.enabled(fake) is True
    monkeypatch.setenv("KVGEN_PDL", "0")
    assert pdl.enabled(fake) is False
    monkeypatch.delenv("KVGEN_PDL")
    assert pdl.enabled(fake) is True  # on by default


def test_the_prefetch_switch_is_whole_kib_or_off(monkeypatch):
    from kvgen.runtime.errors import KvgenRuntimeError

    monkeypatch.delenv(pdl.PREFETCH_SWITCH, raising=False)
    assert pdl.prefetch_bytes() == 0
    for value, want in (("", 0), ("0", 0), ("1", 1024), (" 96 ", 96 * 1024)):
        monkeypatch.setenv(pdl.PREFETCH_SWITCH, value)
        assert pdl.prefetch_bytes() == want, value
    for bad in ("-1", "4k", "1.5", "\u00b2"):  # (a superscript two is a digit to str.isdigit, not to int)
        monkeypatch.setenv(pdl.PREFETCH_SWITCH, bad)
        with pytest.raises(KvgenRuntimeError, match=pdl.PREFETCH_SWITCH):
            pdl.prefetch_bytes()
