"""nuq4's ``codebook`` option (``--kv nuq4:codebook=F``): plans, kernels and packages follow the codebook."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from kvgen.cli import main
from kvgen.registry import default_registry
from kvgen_nuq.codebook import CodebookError
from kvgen_nuq.scheme import CODEBOOK_ENV

SMOLLM2 = str(importlib.resources.files("kvgen_nuq") / "codebooks" / "smollm2-135m.json")
PLAN = ["--model", "llama-3-8b", "--target", "h100"]


def _plan(capsys, kv: str) -> dict:
    assert main(["plan", *PLAN, "--kv", kv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_records_the_codebook_option(capsys):
    default = _plan(capsys, "nuq4")
    by_path = _plan(capsys, f"nuq4:codebook={SMOLLM2}")
    by_name = _plan(capsys, "nuq4:codebook=smollm2-135m")
    assert default["scheme_options"] == {} and by_path["scheme_options"] == {"codebook": SMOLLM2}
    assert by_name["scheme_options"] == {"codebook": "smollm2-135m"}
    for plan in (by_path, by_name):
        assert plan["scheme"] == "nuq4"
        assert plan["scheme_params"]["thresholds"] != default["scheme_params"]["thresholds"]
        assert plan["scheme_params"]["codebooks"] != default["scheme_params"]["codebooks"]
        assert "smollm2-135m.json" in plan["scheme_params"]["codebook_source"]
        assert plan["name"] != default["name"]
    assert by_path["scheme_params"]["codebooks"] == by_name["scheme_params"]["codebooks"]
    # The shipped default chosen explicitly gives the default's codebooks.
    explicit = _plan(capsys, "nuq4:codebook=stories260K")
    assert explicit["scheme_params"]["codebooks"] == default["scheme_params"]["codebooks"]


def test_option_does_not_touch_the_registered_scheme():
    reg = default_registry()
    registered = reg.schemes["nuq4"]
    before = (dict(registered.codebooks), registered.codebook_source, registered.params())
    configured = reg.scheme("nuq4:codebook=smollm2-135m")
    assert configured is not registered and configured.label == "nuq4:codebook=smollm2-135m"
    assert (dict(registered.codebooks), registered.codebook_source, registered.params()) == before
    assert registered.option_values == {} and "smollm2" not in registered.codebook_source


def test_option_wins_over_the_environment_variable(monkeypatch):
    monkeypatch.setenv(CODEBOOK_ENV, "smollm2-135m")
    reg = default_registry()
    scheme = reg.scheme("nuq4:codebook=stories260K")
    assert "stories260K.json" in scheme.codebook_source
    assert reg.scheme("nuq4:codebook=smollm2-135m").params()["codebooks"] != scheme.params()["codebooks"]


def _compile(tmp_path, capsys, kv: str, out: str) -> dict[str, str]:
    folder = tmp_path / out
    assert main(["compile", *PLAN, "--kv", kv, "--out", str(folder), "--json"]) == 0
    capsys.readouterr()
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_compile_follows_the_codebook(tmp_path, capsys):
    a1 = _compile(tmp_path, capsys, "nuq4:codebook=smollm2-135m", "a1")
    a2 = _compile(tmp_path, capsys, "nuq4:codebook=smollm2-135m", "a2")
    b = _compile(tmp_path, capsys, "nuq4:codebook=stories260K", "b")
    assert a1 == a2                                            # same option twice: byte-identical packages
    assert json.loads(a1["plan.json"])["scheme_options"] == {"codebook": "smollm2-135m"}
    ha = {op: k["hash"] for op, k in json.loads(a1["plan.json"])["kernels"].items()}
    hb = {op: k["hash"] for op, k in json.loads(b["plan.json"])["kernels"].items()}
    assert all(ha[op] != hb[op] for op in ha)                  # never one cached kernel for two codebooks
    # The thresholds are baked into the kernel bodies, not only into the spec headers.
    body = lambda src: "\n".join(l for l in src.splitlines() if not l.startswith("#"))
    assert body(a1["kernels/decode.py"]) != body(b["kernels/decode.py"])
    smol = default_registry().scheme("nuq4:codebook=smollm2-135m").params()["thresholds"]["16"]
    assert repr(smol[0]) in a1["kernels/decode.py"] or f"{smol[0]:.9g}" in a1["kernels/decode.py"]


@pytest.mark.parametrize("value, expect", [
    ("/no/such/codebook.json", "no such file"),
    ("no-such-codebook", "smollm2-135m, stories260K"),
    ("", "empty"),
    ("BAD", "is not a kvgen-nuq-codebook/1 file"),
])
def test_bad_codebook_is_one_line_exit_2(tmp_path, capsys, value, expect):
    if value == "BAD":
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"format": "something else"}))
        value = str(bad)
    with pytest.raises(CodebookError, match=expect):
        default_registry().scheme(f"nuq4:codebook={value}")
    assert main(["plan", *PLAN, "--kv", f"nuq4:codebook={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvgen: error:") and "\n" not in err and expect in err


def test_unknown_nuq4_option(capsys):
    assert main(["plan", *PLAN, "--kv", "nuq4:levels=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "scheme nuq4 has no option 'levels'; its options are codebook" in err
