"""CLI: listing commands, and one-line errors with exit code 2 for every user mistake."""

import json
import subprocess
import sys
import types

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


# -- tables: fit the terminal, plain when piped ------------------------------------------------------------------

def _listed_names():
    from kvgen.models import list_models
    from kvgen.registry import default_registry
    from kvgen.targets import list_targets

    return {"models": [m.name for m in list_models()], "targets": [t.name for t in list_targets()],
            "schemes": sorted(default_registry().schemes), "plugins": [p.name for p in default_registry().plugins]}


def test_tables_fit_an_80_column_terminal(capsys, monkeypatch):
    from kvgen import cli

    monkeypatch.setattr(cli, "_is_terminal", lambda: True, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    for command, names in _listed_names().items():
        assert main([command]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= 80, f"kvgen {command}:\n{out}"
        missing = [n for n in names if n not in out]  # no name cut or folded
        assert not missing, f"kvgen {command} lost {missing}:\n{out}"


def test_tables_are_plain_rows_when_piped(capsys, monkeypatch):
    from kvgen import cli
    from kvgen.registry import default_registry

    monkeypatch.setattr(cli, "_is_terminal", lambda: False, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["schemes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(ch in "".join(lines) for ch in "│┃━─"), "box drawing in piped output"
    for name, scheme in default_registry().schemes.items():
        row = [line for line in lines if line.split() and line.split()[0] == name]
        assert len(row) == 1 and scheme.summary in row[0], (name, row)  # one line per row, nothing cut


# -- commands: one entry each, built only when run ---------------------------------------------------------------

HELLO_CALLS = []


def _hello_args(parser):
    parser.add_argument("--who", default="world")


HELLO = types.SimpleNamespace(add_args=_hello_args, run=lambda args: HELLO_CALLS.append((args.who, args.json)) or 0)


def test_a_command_is_one_entry_in_COMMANDS(capsys, monkeypatch):
    from kvgen import cli

    monkeypatch.setitem(cli.COMMANDS, "hello", ("say hello", f"{__name__}:HELLO"))
    assert main(["hello", "--who", "kvgen", "--json"]) == 0 and HELLO_CALLS[-1] == ("kvgen", True)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "say hello" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["hello", "--help"])
    assert "--who" in capsys.readouterr().out


def test_a_plugin_command_named_like_a_builtin_is_ignored_and_reported(capsys, monkeypatch):
    from kvgen import registry
    from kvgen.plugin_api import hookimpl

    class Hijack:
        @hookimpl
        def kvgen_register_commands(self, register):
            register("plan", "not kvgen's plan", lambda parser: (lambda args: 99))

    reg = registry.load_registry(extra_plugins=(Hijack(),), lazy=True)
    monkeypatch.setattr(registry, "default_registry", lambda: reg)
    assert main(["frobnicate"]) == 2  # an unknown name lists plugin commands, and so meets the clash
    assert "kvgen's own" in reg.plugins[-1].error
