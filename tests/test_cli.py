"""CLI: listing commands, and one-line errors with exit code 2 for every user mistake."""

import json
import subprocess
import sys

import pytest

from kvgen.cli import main


@pytest.mark.parametrize("command, key", [("models", "num_layers"), ("targets", "memory_bytes"),
                                          ("schemes", "bytes_per_token_per_kv_head"), ("plugins", "registered")])
def test_listing_commands_json(capsys, command, key):
    assert main([command, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and rows
    assert all(key in r for r in rows)


def test_listing_tables(capsys):
    for command, expect in [("models", "llama-3-70b"), ("targets", "h200"), ("schemes", "bf16"), ("plugins", "float")]:
        assert main([command]) == 0
        assert expect in capsys.readouterr().out


def test_schemes_json_has_required_fields(capsys):
    assert main(["schemes", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fp16"]["bits"] == 16 and rows["fp16"]["bytes_per_token_per_kv_head"] == 512


@pytest.fixture
def bad_config(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return bad, incomplete


BASE = ["plan", "--target", "h100", "--model", "llama-3-8b"]

BAD_INPUTS = {
    "unknown model": (["plan", "--model", "llama3-8b", "--target", "h100"], "llama-3-8b"),
    "unknown target": (["plan", "--model", "llama-3-8b", "--target", "h1000"], "h100"),
    "unknown scheme": (BASE + ["--kv", "int3"], "int3"),
    "unknown scheme with options": (BASE + ["--kv", "int3:residual=16"], "int3"),
    "unknown scheme option": (BASE + ["--kv", "int4:group=64"], "its options are residual"),
    "option on a scheme without options": (BASE + ["--kv", "int8:group=64"], "takes no options"),
    "scheme option without a value": (BASE + ["--kv", "int4:residual"], "key=value"),
    "bad scheme option value": (BASE + ["--kv", "int4:residual=lots"], "residual"),
    "zero context": (BASE + ["--context", "0"], "--context"),
    "negative context": (BASE + ["--context", "-5"], "--context"),
    "non-numeric context": (BASE + ["--context", "lots"], "integer"),
    "zero concurrency": (BASE + ["--concurrency", "0"], "--concurrency"),
    "tp not dividing kv heads": (BASE + ["--tp", "3"], "--tp 3"),
    "tp above heads, not a multiple": (BASE + ["--tp", "12"], "--tp 12"),
    "bad weight bits": (BASE + ["--weight-bits", "3"], "--weight-bits"),
    "bad utilization": (BASE + ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    "page size not power of two": (BASE + ["--page-size", "24"], "--page-size"),
    "page size not a number": (BASE + ["--page-size", "big"], "--page-size"),
    "bad dtype": (BASE + ["--dtype", "int8"], "--dtype"),
    "missing required flag": (["plan", "--model", "llama-3-8b"], "--target"),
    "unknown command": (["frobnicate"], "frobnicate"),
    "weights do not fit": (["plan", "--model", "llama-3.1-405b", "--target", "h100", "--weight-bits", "16"], "--tp"),
    "hub id offline": (["plan", "--model", "someorg/some-model", "--target", "h100"], "config.json"),
    "missing config path": (["plan", "--model", "./no/such/dir/config.json", "--target", "h100"], ""),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(capsys, case):
    argv, expect = BAD_INPUTS[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("kvgen: error:"), err
    assert "\n" not in err, err
    assert "Traceback" not in captured.err
    assert expect in err


def test_unreadable_and_incomplete_config(capsys, bad_config):
    bad, incomplete = bad_config
    for folder, expect in [(bad, "config.json"), (incomplete, "num_hidden_layers")]:
        assert main(["plan", "--model", str(folder), "--target", "h100"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and expect in err, err


def test_console_script_exit_code_and_single_line():
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "plan", "--model", "nope", "--target", "h100"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope" in proc.stderr


def test_a_failing_hook_keeps_the_plugins_other_contributions():
    from kvgen.plugin_api import hookimpl
    from kvgen.registry import load_registry

    class Broken:
        @hookimpl
        def kvgen_register_schemes(self, register):
            raise RuntimeError("codebook file unreadable")

        @hookimpl
        def kvgen_register_commands(self, register):
            register("repair", "fix the data file", lambda parser: (lambda args: 0))

    reg = load_registry(extra_plugins=(Broken(),))
    record = reg.plugins[-1]
    assert "codebook file unreadable" in record.error
    assert "repair" in reg.commands and "fp16" in reg.schemes


def test_a_scheme_with_options_but_no_configure_is_refused_at_registration():
    from kvgen.plugin_api import hookimpl
    from kvgen.registry import load_registry
    from kvgen_plugins.int8 import Int8Scheme

    class HalfDone(Int8Scheme):
        name = "halfdone"
        options = {"clip": "amax clipping factor (float)"}

    class Plugin:
        @hookimpl
        def kvgen_register_schemes(self, register):
            register(HalfDone())

    reg = load_registry(extra_plugins=(Plugin(),))
    assert "halfdone" not in reg.schemes
    assert "does not implement configure()" in reg.plugins[-1].error
