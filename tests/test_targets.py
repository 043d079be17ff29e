"""Target presets, name resolution and --target auto detection (torch.cuda faked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvgen.errors import UnknownTargetError
from kvgen.targets import Target, detect_target, list_targets, resolve_target


def test_h100_preset_and_alias():
    t = resolve_target("H100")
    assert t == resolve_target("h100-sxm")
    assert (t.memory_bytes, t.memory_bandwidth, t.sm_count) == (80e9, 3.35e12, 132)
    assert (t.shared_mem_per_sm, t.l2_bytes, t.arch, t.arch_number) == (228 * 1024, 50 * 2**20, "sm_90", 90)
    assert t.fp8 and t.host_link_bandwidth == 64e9 and t.vendor == "nvidia"


def test_other_presets():
    a100 = resolve_target("a100-80gb")
    assert (a100.name, a100.arch_number, a100.fp8, a100.sm_count) == ("a100", 80, False, 108)
    assert resolve_target("a100-40gb").memory_bandwidth == 1.555e12
    assert resolve_target("h200").memory_bandwidth == 4.8e12
    assert resolve_target("gh200").host_link_bandwidth == 450e9
    assert resolve_target("rtx5090").arch_number == 120
    assert resolve_target("b200").arch_number == 100
    mi = resolve_target("MI300X")
    assert (mi.arch, mi.arch_number, mi.vendor, mi.sm_count) == ("gfx942", 0, "amd", 304)
    assert resolve_target("cpu").arch_number == 0


def test_list_and_round_trip():
    names = {t.name for t in list_targets()}
    assert {"h100", "h100-pcie", "h200", "gh200", "a100", "a100-40gb", "l40s", "rtx4090", "rtx5090", "b200", "mi300x", "cpu"} <= names
    for t in list_targets():
        assert Target(**t.to_json()) == t
        assert t.host_link_measured == ""  # presets are datasheet figures, never a measurement


def test_unknown_target_suggests_names():
    with pytest.raises(UnknownTargetError, match="h100") as e:
        resolve_target("h10")
    assert "kvgen targets" in str(e.value) and "\n" not in str(e.value)


def fake_gpu(monkeypatch, **props):
    base = dict(name="NVIDIA H200", total_memory=150_109_880_320, multi_processor_count=132, major=9, minor=0,
                L2_cache_size=60 * 2**20, shared_memory_per_multiprocessor=233_472)
    base.update(props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(**base))


def test_detect_h200(monkeypatch):
    fake_gpu(monkeypatch)
    t = detect_target()
    assert t.name == "h200" and t.memory_bytes == 150_109_880_320
    assert t.memory_bandwidth == 4.8e12 and t.arch == "sm_90"
    assert resolve_target("auto").name == "h200"


@pytest.mark.parametrize("dev, preset", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
])
def test_detect_by_name(monkeypatch, dev, preset):
    fake_gpu(monkeypatch, name=dev)
    assert detect_target().name == preset


def test_detect_unknown_gpu_estimates_bandwidth(monkeypatch):
    fake_gpu(monkeypatch, name="NVIDIA Mystery X", major=8, minor=6, memory_clock_rate=1_000_000, memory_bus_width=256)
    t = detect_target()
    assert (t.name, t.arch, t.fp8, t.memory_bandwidth) == ("mystery-x", "sm_86", False, 64e9)
    assert "estimated" in t.notes


def test_detect_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnknownTargetError, match="no CUDA GPU"):
        detect_target()
