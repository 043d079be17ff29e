"""kvgen.engine.pdl: when the engine's kernels launch with programmatic dependent launch (the GPU side is
tests/engine/test_gpu.py::test_pdl_launches_give_the_tokens_of_plain_launches)."""

from __future__ import annotations

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
