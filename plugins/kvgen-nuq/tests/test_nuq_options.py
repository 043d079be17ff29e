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


# -- codebook files that are not codebook files (issue 13, item 6) ----------------------------


def _configure_in_thread(spec: str, seconds: float = 30.0):
    """``nuq4`` configured with ``codebook=spec`` in a thread: (finished, exception). A FIFO blocked forever on e6ec643."""
    import threading

    result: dict = {}

    def target():
        try:
            default_registry().schemes["nuq4"].with_options(codebook=spec)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), result.get("exc")


def test_codebook_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "codebook.json"
    os.mkfifo(fifo)
    finished, exc = _configure_in_thread(str(fifo))
    if not finished:  # let the blocked reader go (a writer that closes at once: EOF), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert finished, "reading a FIFO codebook blocked"
    assert isinstance(exc, CodebookError) and "not a regular file" in str(exc)


def test_codebook_device_is_refused(tmp_path):
    finished, exc = _configure_in_thread("/dev/zero")
    assert finished and isinstance(exc, CodebookError) and "not a regular file" in str(exc)


def test_codebook_file_size_is_bounded(tmp_path):
    from kvgen_nuq.codebook import MAX_FILE_BYTES

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(CodebookError, match="larger than"):
        default_registry().schemes["nuq4"].with_options(codebook=str(big))


@pytest.mark.parametrize("books, expect", [
    ({"16": [0.0] * 16}, "got a JSON list"),                                       # list-valued page
    ({"16": {"pooled": [i / 8 - 1 for i in range(16)], "layers": 3}}, "'layers' a JSON int"),
    ({"16": "levels"}, "got a JSON str"),
])
def test_codebook_pages_must_be_objects(tmp_path, capsys, books, expect):
    path = tmp_path / "cb.json"
    path.write_text(json.dumps({"format": "kvgen-nuq-codebook/1", "codebooks": books}))
    assert main(["plan", *PLAN, "--kv", f"nuq4:codebook={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvgen: error:") and expect in err[0], err


def test_codebook_deeply_nested_json(tmp_path, capsys):
    path = tmp_path / "cb.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["plan", *PLAN, "--kv", f"nuq4:codebook={path}"]) == 2
    assert "nests JSON too deeply" in capsys.readouterr().err
