"""kvgen probe (issue 17): the timing core with a fake timer, storage, --target auto reading a stored probe,
the plan's reason saying measured vs preset, and the command's one-line refusal without a GPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from kvgen import cli, probe
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.targets import detect_target, resolve_target


class FakeClock:
    """A timer that a fake copy advances by nbytes / rate seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_median_bandwidth_takes_the_median_and_skips_the_warmup():
    clock = FakeClock()
    durations = iter([100.0, 1.0, 2.0, 4.0, 8.0, 16.0])  # the first (warm-up) run is slow and not counted
    calls = []

    def copy():
        calls.append(1)
        clock.now += next(durations)

    bw = probe.median_bandwidth(copy, 8_000, timer=clock, repeats=5)
    assert len(calls) == 6 and bw == 8_000 / 4.0


def test_median_bandwidth_refuses_a_zero_timer():
    with pytest.raises(probe.ProbeError, match="timer"):
        probe.median_bandwidth(lambda: None, 10, timer=lambda: 1.0, repeats=2)


def test_measure_with_fake_copies():
    clock = FakeClock()
    rates = {"h2d": 50e9, "d2h": 40e9, "d2d": 1e12}
    made = []

    def make_copy(kind, size, count):
        made.append((kind, size, count))
        # small chunks pay a fixed 10 us per copy on top of the link rate
        def copy():
            clock.now += count * (size / rates[kind] + (10e-6 if size < 2**20 else 0))
        return copy

    r = probe.measure(make_copy, timer=clock, repeats=3, large_sizes=(2**26, 2**28), chunk_sizes=(2**16, 2**22))
    assert r["host_to_device_bandwidth"] == pytest.approx(50e9)
    assert r["device_to_host_bandwidth"] == pytest.approx(40e9)
    assert r["device_copy_bandwidth"] == pytest.approx(1e12)
    assert r["chunks"]["h2d"][str(2**22)] == pytest.approx(50e9)
    assert r["chunks"]["h2d"][str(2**16)] < 0.2 * 50e9  # the per-copy cost shows in small chunks
    assert ("h2d", 2**16, probe.chunk_count(2**16)) in made and probe.chunk_count(2**16) > 1
    json.dumps(r)  # storable as is


def stored(monkeypatch, tmp_path, device="NVIDIA H200", h2d=52.5e9, date="2026-11-30"):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    result = {"format": probe.FORMAT, "device": device, "date": date, "torch": "x", "cuda": "12.4", "driver": None,
              "host_to_device_bandwidth": h2d, "device_to_host_bandwidth": 50e9, "device_copy_bandwidth": 2e12,
              "large": {}, "chunks": {}}
    return result, probe.save_probe(result)


def test_storage_round_trip(monkeypatch, tmp_path):
    result, path = stored(monkeypatch, tmp_path, device="NVIDIA H100 80GB HBM3")
    assert path == tmp_path / "probe" / "nvidia-h100-80gb-hbm3.json"
    assert probe.load_probe("NVIDIA H100 80GB HBM3") == result
    assert probe.load_probe("NVIDIA H200") is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    path.write_text("{not json")
    assert probe.load_probe("NVIDIA H100 80GB HBM3") is None
    path.write_text(json.dumps({**result, "host_to_device_bandwidth": -1}))
    assert probe.load_probe("NVIDIA H100 80GB HBM3") is None


def fake_gpu(monkeypatch, name="NVIDIA H200"):
    props = dict(name=name, total_memory=150_109_880_320, multi_processor_count=132, major=9, minor=0,
                 L2_cache_size=60 * 2**20, shared_memory_per_multiprocessor=233_472)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(**props))


def test_detect_target_uses_a_stored_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    fake_gpu(monkeypatch)
    before = detect_target()
    assert before.host_link_bandwidth == 64e9 and before.host_link_measured == ""
    stored(monkeypatch, tmp_path)
    t = detect_target()
    assert t.host_link_bandwidth == 52.5e9 and t.host_link_measured == "2026-11-30"
    assert "measured by kvgen probe on 2026-11-30" in t.notes
    fake_gpu(monkeypatch, name="NVIDIA Mystery X")  # no preset, no probe of its own
    assert detect_target().host_link_measured == ""


def host_plan(target):
    model = dataclasses.replace(resolve_model("llama-3-8b"), max_positions=131072)  # Llama-3.1's positions
    return make_plan(model, target, Workload(context=32768, concurrency=40, weight_bits=16),
                     default_registry().schemes, kv="bf16")


def test_plan_reason_says_measured_or_preset(monkeypatch, tmp_path):
    preset = host_plan(resolve_target("h200"))
    assert preset.tiering == "host"
    assert any("host link 64.0 GB/s (preset, not measured: run kvgen probe)" in r for r in preset.reasons)
    stored(monkeypatch, tmp_path)
    fake_gpu(monkeypatch)
    measured = host_plan(resolve_target("auto"))
    assert any("host link 52.5 GB/s (measured by kvgen probe on 2026-11-30)" in r for r in measured.reasons)
    # the step-time prediction uses the measured figure
    assert measured.host_transfer_ms_per_step == pytest.approx(measured.host_tier_bytes / 52.5e9 * 1e3, rel=1e-4)


def test_probe_without_gpu_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(probe.ProbeError, match="needs a CUDA GPU"):
        probe.run(argparse.Namespace(repeats=1, json=False))
    # through the CLI, as the COMMANDS line registers it
    monkeypatch.setitem(cli.COMMANDS, "probe", ("measure this GPU's host link and copy bandwidth", "kvgen.probe"))
    assert cli.main(["probe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a CUDA GPU" in err and "\n" not in err
    assert not (tmp_path / "probe").exists()
