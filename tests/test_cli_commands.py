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


def test_generate_without_a_gpu_uses_the_interpreter_by_itself(shared_data):
    """No TRITON_INTERPRET in the environment and no GPU: kvgen generate switches to the interpreter itself."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", "generate", "--model",
                           str(shared_data / "models" / "stories260K"), "--kv", "int8", "--prompt", "Once upon",
                           "--max-tokens", "3", "--device", "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Triton CPU interpreter" in proc.stderr
    assert proc.stdout.strip()


def test_a_runtime_error_from_a_generated_package_is_one_line(capsys, monkeypatch):
    """A generated package carries its own copy of the runtime's errors; the CLI still prints one line, exit 2."""
    import kvgen.cli as cli

    Copy = type("KvgenRuntimeError", (Exception,), {"__module__": "kvgen_generated_x.runtime.errors"})
    Sub = type("OutOfPages", (Copy,), {"__module__": "kvgen_generated_x.runtime.errors"})

    def boom(args):
        raise Sub("the compressed pool is out of pages; free a sequence")

    monkeypatch.setitem(cli.__dict__, "MODELS", cli.Command(cli.MODELS.add_args, boom))
    rc, _, err = _run(capsys, "models")
    assert rc == 2 and err.strip() == "kvgen: error: the compressed pool is out of pages; free a sequence"


def test_other_exceptions_still_raise(capsys, monkeypatch):
    import kvgen.cli as cli

    def boom(args):
        raise ZeroDivisionError("bug")

    monkeypatch.setitem(cli.__dict__, "MODELS", cli.Command(cli.MODELS.add_args, boom))
    with pytest.raises(ZeroDivisionError):
        main(["models"])
