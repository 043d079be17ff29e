"""The commands wired into kvgen's CLI from their own rooms: generate (engine), serve (server), tune (runtime)."""

import pytest

from kvgen.cli import main


def _run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", ["generate", "serve", "tune"])
def test_command_is_listed_and_has_help(capsys, command):
    rc, out, _ = _run(capsys, command, "--help")
    assert rc == 0
    assert f"usage: kvgen {command}" in out


def test_tune_refuses_a_folder_that_is_not_a_package(capsys, tmp_path):
    rc, _, err = _run(capsys, "tune", str(tmp_path))
    assert rc == 2
    assert "not a kvgen package" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag,value", [("--batch", "0"), ("--context", "x,y")])
def test_tune_refuses_bad_sizes(capsys, tmp_path, flag, value):
    rc, _, err = _run(capsys, "tune", str(tmp_path), flag, value)
    assert rc == 2 and flag in err


def test_compile_refuses_an_unknown_backend(capsys, tmp_path):
    rc, _, err = _run(capsys, "compile", "--model", "llama-3-8b", "--target", "h100", "--kv", "int8",
                      "--backend", "opencl", "--out", str(tmp_path / "p"))
    assert rc == 2 and "--backend" in err
    assert not (tmp_path / "p").exists()


def test_compile_cuda_backend_notes_the_ops_that_stay_triton(capsys, tmp_path):
    rc, out, _ = _run(capsys, "compile", "--model", "llama-3-8b", "--target", "h100", "--kv", "int8",
                      "--backend", "cuda", "--out", str(tmp_path / "p"))
    assert rc == 0, out
    assert "note: cache_write stays Triton" in out
    assert (tmp_path / "p" / "manifest.json").is_file()
