"""Planner: the memory model's numbers, recomputed by hand, and each decision."""

import dataclasses
import json
import math

import pytest

from kvgen.cli import main
from kvgen.errors import PlanError, WorkloadError
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.targets import resolve_target


def plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama2_70b_fp16_is_320_kib_per_token_not_40_mb(capsys):
    # 80 layers x 8 KV heads x 128 head_dim x (K and V) x 2 bytes. The seed
    # article's "40 MB per token" multiplied by the hidden size (8192) instead.
    p = plan_json(capsys, "--model", "llama-2-70b", "--target", "h100", "--kv", "fp16")
    assert p["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2 == 327680
    assert p["kv_bytes_per_token"] != 2 * 80 * 8 * 8192 * 2


def test_llama3_8b_bf16(capsys):
    p = plan_json(capsys, "--model", "llama-3-8b", "--target", "h100", "--kv", "bf16")
    assert p["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 131072
    for key in ("model", "target", "scheme", "page_size", "tp", "kv_bytes_per_token", "kv_bytes_per_token_per_gpu",
                "weight_bytes", "kv_budget_bytes", "capacity_tokens", "capacity_sequences", "tiering", "reasons"):
        assert key in p


@pytest.mark.parametrize("kv, per_head", [
    ("int8", 2 * (128 + 4)),              # K and V: 128 int8 codes + one fp32 scale per token and head
    ("fp8", 2 * (128 + 4)),
    ("int4", (64 + 2 * 2 * 128 / 16) + (64 + 2 * 2 * 128 / 32)),  # KIVI: K per-channel scale+zero per page, V per 32-channel group
    ("int2", (32 + 2 * 2 * 128 / 16) + (32 + 2 * 2 * 128 / 32)),
])
def test_quantized_bytes_per_token_include_scales(capsys, kv, per_head):
    if kv not in default_registry().schemes:
        pytest.skip(f"scheme {kv} not registered")
    scheme = default_registry().schemes[kv]
    assert scheme.bytes_per_token_per_kv_head(128, 16) == pytest.approx(per_head)
    p = plan_json(capsys, "--model", "llama-3-8b", "--target", "h100", "--kv", kv, "--page-size", "16")
    assert p["kv_bytes_per_token"] == 32 * 8 * per_head


def test_capacity_recomputed_independently(capsys):
    p = plan_json(capsys, "--model", "llama-3-70b", "--target", "h100", "--kv", "int4", "--context", "8192",
                  "--concurrency", "64", "--weight-bits", "4")
    model, target = resolve_model("llama-3-70b"), resolve_target("h100")
    # By hand: weights at 4 bits, 90% of memory, a 2 GiB workspace.
    weights = model.num_params * 4 // 8
    budget = math.floor(target.memory_bytes * 0.9) - weights - 2 * 2**30
    assert p["weight_bytes"] == weights
    assert abs(p["kv_budget_bytes"] - budget) <= 1
    page = p["page_size"]
    assert page == 16
    # KIVI int4 at D=128, page 16: 64 B K codes + 32 B K scale/zero amortised + 64 B V codes + 16 B V scale/zero.
    per_token_gpu = 80 * 8 * (64 + 32 + 64 + 16)
    assert p["kv_bytes_per_token_per_gpu"] == per_token_gpu
    # The tail page of each of the 64 sequences stays in bf16 (K and V, 2 bytes).
    residual_pool = 64 * page * (80 * 8 * 2 * 128 * 2)
    pages = (budget - residual_pool) // (page * per_token_gpu)
    assert p["capacity_tokens"] == (pages + 64) * page
    sequences = min(pages // (8192 // page), 64)
    assert p["capacity_sequences"] == sequences
    # 64 x 8192 tokens at 112,640 B/token is ~59 GB: more than the ~34.6 GB budget, so a host tier.
    assert sequences < 64 and p["tiering"] == "host"
    assert p["host_tier_bytes"] == (64 - sequences) * 8192 * per_token_gpu


def test_405b_at_16_bits_on_one_h100_is_refused_with_the_arithmetic(capsys):
    assert main(["plan", "--model", "llama-3.1-405b", "--target", "h100", "--weight-bits", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "weights" in err and "--tp" in err
    assert f"{405853388800 * 2:,}" in err


def test_tp4_shards_kv_heads(capsys):
    p = plan_json(capsys, "--model", "llama-3-70b", "--target", "h100", "--kv", "bf16", "--tp", "4")
    assert p["kv_heads_per_gpu"] == 2
    assert p["kv_bytes_per_token_per_gpu"] * 4 == p["kv_bytes_per_token"]
    assert any("sharded to 2 per GPU" in r for r in p["reasons"])


def test_tp16_replicates_and_says_so(capsys):
    p = plan_json(capsys, "--model", "llama-3-70b", "--target", "h100", "--kv", "bf16", "--tp", "16")
    assert p["kv_heads_per_gpu"] == 1 and p["kv_replication"] == 2
    assert any("replicated" in r for r in p["reasons"])


def llama_3_8b_long():
    """llama-3-8b's shapes with Llama-3.1's 128K positions: long contexts are within the model's range."""
    return dataclasses.replace(resolve_model("llama-3-8b"), max_positions=131072)


def test_auto_prefers_precise_scheme_that_fits_then_compact():
    model, target = llama_3_8b_long(), resolve_target("h100")
    schemes = default_registry().schemes
    small = make_plan(model, target, Workload(context=4096, concurrency=4), schemes, kv="auto")
    assert small.scheme == "bf16"
    assert any("most precise" in r for r in small.reasons)
    big = make_plan(model, target, Workload(context=32768, concurrency=64), schemes, kv="auto")
    assert big.scheme != "bf16"
    bf16 = make_plan(model, target, Workload(context=32768, concurrency=64), schemes, kv="bf16")
    assert big.kv_bytes_per_token < bf16.kv_bytes_per_token


def test_host_tier_when_gpu_is_short_and_refusal_when_host_is_short_too():
    model, target = llama_3_8b_long(), resolve_target("h100")
    schemes = default_registry().schemes
    plan = make_plan(model, target, Workload(context=32768, concurrency=20, weight_bits=16), schemes, kv="bf16")
    assert plan.tiering == "host" and plan.host_tier_bytes > 0 and plan.host_transfer_ms_per_step > 0
    assert any("host link 64.0 GB/s (preset, not measured: run kvgen probe)" in r for r in plan.reasons)
    with pytest.raises(PlanError):
        make_plan(model, target, Workload(context=32768, concurrency=20, weight_bits=16, host_memory_bytes=2**30), schemes, kv="bf16")


def test_plan_prints_formula_with_numbers(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--target", "h100", "--kv", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "kv_bytes_per_token = b_head*kv_heads*layers" in out or "kv_bytes_per_token = " in out
    assert "131,072" in out


def test_page_size_reason_mentions_fragmentation():
    model, target = resolve_model("llama-3-8b"), resolve_target("h100")
    plan = make_plan(model, target, Workload(context=8192), default_registry().schemes, kv="bf16")
    assert plan.page_size == 16
    assert any("waste" in r for r in plan.reasons)


def test_workload_validation():
    with pytest.raises(WorkloadError):
        Workload(context=0)
    with pytest.raises(WorkloadError):
        Workload(page_size=24)


def test_plan_name_differs_by_compute_dtype(capsys):
    """--dtype fp16 and bf16 compile different kernels: their packages must not share a folder (issue 13)."""
    names = {d: plan_json(capsys, "--model", "llama-3-8b", "--target", "h100", "--kv", "int4", "--dtype", d)["name"]
             for d in ("bf16", "fp16", "fp32")}
    assert len(set(names.values())) == 3
    assert names["bf16"] == "llama_3_8b_h100_int4_tp1_p16"  # the default keeps its name


def test_host_step_cost_overlaps_transfer_with_attention():
    """The runtime stages cold pages one layer ahead: a step costs max(GPU, transfer) plus one layer's
    share of the smaller, never their sum."""
    from kvgen.planner.host_cost import host_step_cost

    # transfer-bound: 10 GB cold at 50 GB/s = 200 ms; 20 GB read at 5 TB/s = 4 ms; 32 layers
    c = host_step_cost(10e9, 10e9, 5e12, 50e9, 32)
    assert c.transfer_ms == pytest.approx(200.0) and c.gpu_ms == pytest.approx(4.0)
    assert c.step_ms == pytest.approx(200.0 + 4.0 / 32)
    assert c.step_ms < c.transfer_ms + c.gpu_ms - 3.5
    # GPU-bound: little cold data
    g = host_step_cost(100e9, 0.05e9, 5e12, 50e9, 32)
    assert g.step_ms == pytest.approx(g.gpu_ms + 1.0 / 32)
    # nothing cold: the device read alone
    assert host_step_cost(10e9, 0, 5e12, 50e9, 32).step_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        host_step_cost(1, 1, 5e12, 0, 32)


def test_host_plan_predicts_the_overlapped_step():
    model, target = llama_3_8b_long(), resolve_target("h100")
    plan = make_plan(model, target, Workload(context=32768, concurrency=20, weight_bits=16),
                     default_registry().schemes, kv="bf16")
    host = plan.host_tier_bytes
    device = plan.capacity_sequences * 32768 * plan.kv_bytes_per_token_per_gpu
    gpu = (device + host) / target.memory_bandwidth * 1e3
    transfer = host / target.host_link_bandwidth * 1e3
    assert plan.host_transfer_ms_per_step == pytest.approx(transfer, rel=1e-4)
    assert plan.host_step_ms == pytest.approx(max(gpu, transfer) + min(gpu, transfer) / model.num_layers, rel=1e-4)
    assert plan.host_step_ms < gpu + transfer
    assert any(f"about {plan.host_step_ms:.2f} ms" in r for r in plan.reasons)
    fits = make_plan(model, target, Workload(context=4096, concurrency=1, weight_bits=16),
                     default_registry().schemes, kv="bf16")
    assert fits.tiering == "none" and fits.host_step_ms == 0.0 and fits.host_transfer_ms_per_step == 0.0
