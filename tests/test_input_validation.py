"""Bad input a user can give kvgen: each is a one-line KvgenError (exit 2 from the CLI) or correct behaviour.

Every case here was accepted silently (and planned wrong), raised a raw
traceback, or hung on e6ec643 (issue 13, items 6 and 13).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvgen.cli import main
from kvgen.errors import ModelConfigError, SchemeOptionError, WorkloadError
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.targets import resolve_target

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2, hidden_size=256,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, vocab_size=1000,
              max_position_embeddings=2048, tie_word_embeddings=False)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``kvgen ARGV`` -> (exit status, stdout, stderr); SystemExit counts as a return."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(capsys, *argv: str, match: str) -> str:
    rc, _, err = cli(capsys, *argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgen: error:"), err
    assert match in lines[0], lines[0]
    return lines[0]


def write_config(tmp_path: Path, text: str | None = None, **changes) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(text if text is not None else json.dumps({**CONFIG, **changes}))
    return str(path)


def plan_args(model: str, *extra: str) -> list[str]:
    return ["plan", "--model", model, "--target", "h100", *extra]


# -- model configs --------------------------------------------------------------------------


@pytest.mark.parametrize("window", [-5, 0])
def test_sliding_window_must_be_positive(tmp_path, capsys, window):
    cfg = write_config(tmp_path, sliding_window=window)
    assert_one_line_error(capsys, *plan_args(cfg), match="sliding_window")
    with pytest.raises(ModelConfigError, match="positive number of tokens"):
        resolve_model(cfg)


def test_null_sliding_window_is_full_attention(tmp_path):
    assert resolve_model(write_config(tmp_path, sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("theta", ["NaN", "Infinity", "-Infinity", "0", "-1"])
def test_rope_theta_must_be_finite_and_positive(tmp_path, capsys, theta):
    text = json.dumps(CONFIG)[:-1] + f', "rope_theta": {theta}}}'
    cfg = write_config(tmp_path, text)
    assert_one_line_error(capsys, *plan_args(cfg, "--json"), match="rope_theta")


def test_modelspec_refuses_non_finite_rope_theta():
    spec = resolve_model("llama-3-8b")
    for bad in (math.nan, math.inf, 0.0):
        with pytest.raises(ModelConfigError, match="rope_theta"):
            dataclasses.replace(spec, rope_theta=bad)


@pytest.mark.parametrize("archs", ["LlamaForCausalLM", [1], [""], {"a": 1}])
def test_architectures_must_be_a_list_of_names(tmp_path, capsys, archs):
    cfg = write_config(tmp_path, architectures=archs)
    assert_one_line_error(capsys, *plan_args(cfg), match="architectures")


def test_architectures_list_records_the_first_name(tmp_path):
    spec = resolve_model(write_config(tmp_path, architectures=["MistralForCausalLM", "Other"]))
    assert spec.architecture == "MistralForCausalLM"


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size", "num_hidden_layers"])
def test_zero_heads_or_sizes_are_config_errors(tmp_path, capsys, key):
    cfg = write_config(tmp_path, **{key: 0})
    assert_one_line_error(capsys, *plan_args(cfg), match=key)


@pytest.mark.parametrize("shape", ["array", "object"])
def test_deeply_nested_json_is_a_config_error(tmp_path, capsys, shape):
    deep = "[" * 100_000 + "]" * 100_000
    text = deep if shape == "array" else json.dumps(CONFIG)[:-1] + f', "x": {deep}}}'
    assert_one_line_error(capsys, *plan_args(write_config(tmp_path, text)), match="nests JSON too deeply")


# -- workload -------------------------------------------------------------------------------


def test_context_beyond_max_positions_is_refused(capsys):
    line = assert_one_line_error(capsys, *plan_args("llama-3-8b", "--context", "100000"), match="--context 100000")
    assert "8192" in line and "max_position_embeddings" in line
    # the limit itself plans
    rc, _, err = cli(capsys, *plan_args("llama-3-8b", "--context", "8192", "--json"))
    assert rc == 0, err


def test_context_beyond_max_positions_library():
    with pytest.raises(WorkloadError, match="max_position_embeddings"):
        make_plan(resolve_model("llama-2-7b"), resolve_target("h100"), Workload(context=4097),
                  default_registry().schemes, kv="bf16")


@pytest.mark.parametrize("gib", [math.nan, math.inf, -1.0])
def test_host_memory_must_be_finite(gib):
    from kvgen.planner.workload import host_memory_bytes

    with pytest.raises(WorkloadError, match="--host-memory"):
        host_memory_bytes(gib)
    with pytest.raises(WorkloadError, match="--host-memory"):
        Workload(host_memory_bytes=gib)
    assert host_memory_bytes(1.5) == 3 * 2**29


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cli_host_memory_nan_inf(capsys, value):
    assert_one_line_error(capsys, *plan_args("llama-3-8b", "--host-memory", value), match="--host-memory")


# -- KIVI residual option -------------------------------------------------------------------


def test_huge_residual_is_refused_at_plan_time(capsys):
    line = assert_one_line_error(capsys, *plan_args("llama-3-8b", "--kv", f"int4:residual={10**21}"),
                                 match="residual")
    assert str(2**20) in line


def test_residual_no_page_divides_names_the_valid_residuals(capsys):
    line = assert_one_line_error(capsys, *plan_args("llama-3-8b", "--kv", "int4:residual=50"), match="residual=50")
    assert "multiple of 8" in line and "48 or 56" in line
    assert "--page-size" not in line  # no page size can fix it: the residual is what to change
    with pytest.raises(SchemeOptionError, match="multiple of 16"):
        default_registry().schemes["int2"].with_options(residual="40")


def test_residual_only_small_pages_divide_plans_with_such_a_page():
    plan = make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(),
                     default_registry().schemes, kv="int4:residual=24")
    assert plan.page_size == 8 and plan.scheme_params["residual_tokens"] == 24


def test_residual_and_page_size_conflict_names_both_fixes(capsys):
    line = assert_one_line_error(capsys, *plan_args("llama-3-8b", "--kv", "int4:residual=48", "--page-size", "32"),
                                 match="48 residual tokens")
    assert "--page-size 8 or 16" in line and "int4:residual=64" in line


# -- integrations ---------------------------------------------------------------------------


def test_cache_dir_that_is_a_file_under_attach(tmp_path, monkeypatch, shared_data):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from kvgen.integrations.transformers import KvgenIntegrationError, attach

    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(blocker))
    model = AutoModelForCausalLM.from_pretrained(shared_data / "models" / "stories260K")
    with pytest.raises(KvgenIntegrationError, match="KVGEN_CACHE_DIR") as exc:
        attach(model, scheme="int8")
    assert "\n" not in str(exc.value) and str(blocker) in str(exc.value)
    assert blocker.read_text() == "not a folder"


# -- --kv auto: what the plan assumes that kvgen does not do ----------------------------------


def test_plan_warnings_name_host_tier_and_weight_quantization():
    from kvgen.planner.planner import plan_warnings

    schemes = default_registry().schemes
    model, target = resolve_model("llama-3-70b"), resolve_target("h100")
    plan = make_plan(model, target, Workload(context=8192, concurrency=256), schemes, kv="auto")
    assert plan.tiering == "host" and plan.workload["weight_bits"] == 4  # what auto picks, silently on e6ec643
    warnings = plan_warnings(plan)
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert any("4-bit weights" in w and "does not quantize" in w for w in warnings)
    assert any("host tier" in w and f"--concurrency to {plan.capacity_sequences}" in w for w in warnings)
    # a plan that fits at 16 bits needs nothing kvgen does not do
    assert plan_warnings(make_plan(model, target, Workload(context=4096, tp=4), schemes, kv="auto")) == []


def test_cli_prints_plan_warnings_on_stderr(capsys):
    rc, out, err = cli(capsys, *plan_args("llama-3-70b", "--context", "8192", "--concurrency", "256", "--json"))
    assert rc == 0 and json.loads(out)["tiering"] == "host"
    assert "host tier" in err and "does not quantize" in err
