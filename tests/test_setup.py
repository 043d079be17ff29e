"""Set-up and packaging: the wheels, the declared dependencies, scripts/setup.sh, and a clone's self-sufficiency.

Everything here runs offline: wheels are built from a copy of the sources with the
installed setuptools, and setup.sh runs against a stub interpreter that records
the pip commands it is given.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
NUQ = REPO / "plugins" / "kvgen-nuq"


def _build_wheel(sources: list[Path], root: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """Build a wheel of ``root`` from a copy of ``sources``; return setuptools' output and the wheel's file names."""
    work = tmp_path / "src"
    work.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for src in sources:
        dst = work / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree(src, dst, ignore=skip) if src.is_dir() else shutil.copy(src, dst))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))",
         str(tmp_path / "dist")],
        cwd=work, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    with zipfile.ZipFile(tmp_path / "dist" / proc.stdout.strip().splitlines()[-1]) as whl:
        return output, whl.namelist()


def _setuptools_warnings(output: str) -> list[str]:
    # setuptools' own warnings are Python warnings (SetuptoolsDeprecationWarning, _Warning: ...);
    # "warning: build_py: byte-compiling is disabled" only reflects PYTHONDONTWRITEBYTECODE.
    return [line for line in output.splitlines() if "Warning" in line]


def test_kvgen_wheel_builds_without_warnings_and_ships_kvgen_only(tmp_path):
    output, names = _build_wheel(
        [REPO / "pyproject.toml", REPO / "README.md", REPO / "kvgen", REPO / "plugins", REPO / "templates"],
        REPO, tmp_path)
    assert _setuptools_warnings(output) == []
    names = set(names)
    # Every module of kvgen, every built-in plugin and every template ships (a new subpackage
    # missing from pyproject's package list fails here)...
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "kvgen").rglob("*") if p.suffix in (".py", ".cu")
                and "__pycache__" not in p.parts}
    expected |= {"kvgen_plugins/" + p.name for p in (REPO / "plugins").glob("*.py")}
    expected |= {"kvgen_plugins/macros/" + p.relative_to(REPO / "plugins" / "macros").as_posix()
                 for p in (REPO / "plugins" / "macros").rglob("*.j2")}
    expected |= {"kvgen_templates/" + p.relative_to(REPO / "templates").as_posix()
                 for p in (REPO / "templates").rglob("*") if p.suffix in (".py", ".j2")}
    assert expected - names == set()
    # ...and nothing of kvgen-nuq, a distribution of its own.
    assert [n for n in names if "nuq" in n or n.endswith(".json")] == []
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert metadata


def test_nuq_wheel_builds_without_warnings_with_its_data(tmp_path):
    output, names = _build_wheel([NUQ / "pyproject.toml", NUQ / "kvgen_nuq"], NUQ, tmp_path)
    assert _setuptools_warnings(output) == []
    data = {p.relative_to(NUQ).as_posix() for p in (NUQ / "kvgen_nuq").rglob("*") if p.suffix in (".j2", ".json")}
    assert data and data <= set(names)


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {r.name.lower(): r for r in reqs}


def test_triton_is_required_only_where_it_installs():
    triton = _requirements()["triton"]
    assert triton.marker is not None
    assert triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin"})
    assert not triton.marker.evaluate({"platform_system": "Windows"})


def test_declared_ranges_admit_the_tested_versions_and_exclude_the_broken_ones():
    from importlib.metadata import version

    reqs = _requirements()
    for name in ("torch", "triton", "transformers"):  # CI tests with what is installed
        assert reqs[name].specifier.contains(version(name).split("+")[0]), (name, version(name))
    assert reqs["torch"].specifier.contains("2.11.0") and reqs["triton"].specifier.contains("3.6.0")  # the H200's
    # transformers 4.x cannot read the test model's tokenizer files; up to 5.12 CacheLayerMixin's
    # get_max_cache_shape is abstract; up to 5.23 generate() names its cache "past_key_values" and
    # attach()'s hook never sees it (generate silently runs on HF's own cache).
    for broken in ("4.45.0", "4.57.6", "5.0.0", "5.12.0", "5.13.0", "5.23.0"):
        assert not reqs["transformers"].specifier.contains(broken), broken


# -- scripts/setup.sh against a stub interpreter ----------------------------------------

STUB_PYTHON = """#!/bin/bash
# Records every call; "import torch" fails (torch absent), PyTorch's index fails when INDEX_DOWN=1.
echo "$*" >> "$SETUP_LOG"
case "$*" in
  "-c import torch") exit 1 ;;
  *--index-url*) [ "${INDEX_DOWN:-0}" = 1 ] && exit 1 ;;
esac
exit 0
"""


@pytest.fixture
def setup_tree(tmp_path):
    """A copy of scripts/setup.sh in a fake checkout whose .venv/bin/python is the stub; PATH holds only
    the tools the script needs (so no nvidia-smi unless a test adds one)."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", tree / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    stub = tree / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "touch", "dirname", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    return tree, bin_dir


def _run_setup(tree: Path, bin_dir: Path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tree.parent / "calls.log"
    proc = subprocess.run([str(bin_dir / "bash"), str(tree / "scripts" / "setup.sh"), "test"],
                          env={"PATH": str(bin_dir), "SETUP_LOG": str(log), **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc, log.read_text().splitlines() if log.exists() else []


def _torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if re.search(r"install .*\btorch\b", c) and "-e " not in c]


def test_setup_without_gpu_takes_the_cpu_build_from_pytorchs_index(setup_tree):
    tree, bin_dir = setup_tree
    _, calls = _run_setup(tree, bin_dir)
    (torch,) = _torch_installs(calls)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch and "torch==2.13.0" in torch
    assert "--timeout 5" in torch and "--retries 0" in torch  # an index that does not answer costs seconds
    assert all(" -qq " in f" {c} " for c in calls if c.startswith("-m pip install"))  # quiet
    assert any('-e .[test]' in c for c in calls)
    # A second run finds its stamp and installs nothing.
    _, again = _run_setup(tree, bin_dir)
    assert again == calls


def test_setup_without_gpu_falls_back_to_the_package_index(setup_tree):
    tree, bin_dir = setup_tree
    proc, calls = _run_setup(tree, bin_dir, INDEX_DOWN="1")
    first, second = _torch_installs(calls)
    assert "--index-url" in first
    assert second == "-m pip install -qq torch==2.13.0"  # the CPU build, never an unpinned (CUDA) torch
    assert "did not answer" in proc.stderr


def test_setup_with_an_nvidia_gpu_takes_pips_default_build(setup_tree):
    tree, bin_dir = setup_tree
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/bash\necho 'GPU 0: NVIDIA H200'\n")
    smi.chmod(0o755)
    _, calls = _run_setup(tree, bin_dir)
    (torch,) = _torch_installs(calls)
    assert "--index-url" not in torch and "torch>=2.11" in torch


# -- a clone is self-sufficient -----------------------------------------------------------

# What a clone cannot reach: the folder beside the checkout that the project's own
# machines happen to have. (Spelled in pieces so this file does not match itself.)
OUTSIDE = re.compile(r"\.\./" + r"shared|\.parent\s*/\s*[\"']" + r"shared")
SCANNED = ["README.md", "Makefile", "pyproject.toml", ".ci", "scripts", "examples", "docs", "tests", "kvgen",
           "plugins", "templates"]


def test_nothing_reaches_outside_the_repository():
    offenders = []
    for top in SCANNED:
        path = REPO / top
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            if "__pycache__" in f.parts or ".egg-info" in str(f) or f.suffix in (".safetensors", ".model", ".pyc"):
                continue
            text = f.read_text(errors="replace")
            offenders += [f"{f.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}" for m in OUTSIDE.finditer(text)]
    assert offenders == []


def test_vendored_assets_match_their_readme():
    assets = REPO / "tests" / "assets"
    listed = re.findall(r"^([0-9a-f]{64})  (\S+)$", (assets / "README.md").read_text(), re.M)
    assert len(listed) == 6
    for digest, rel in listed:
        assert hashlib.sha256((assets / rel).read_bytes()).hexdigest() == digest, rel
    for license_file in ("LICENSE-stories260K-MIT.txt", "LICENSE-CDLA-Sharing-1.0.txt"):
        assert (assets / license_file).stat().st_size > 500


# -- the README's first commands and examples ---------------------------------------------

def _readme_blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)


def test_readme_begins_with_the_two_make_commands():
    lang, first = _readme_blocks()[0]
    assert first.split("\n")[:-1] == ["make run", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test:\n(\t.*\n)*\t.*pytest .*-rs", makefile, re.M)  # skip reasons are shown


def test_readme_import_example_names_the_package_make_run_builds(capsys):
    import json

    from kvgen.cli import main

    run = re.search(r"^run:\n(?:\t.*\n)*?\t\S*kvgen compile (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert main(["plan", *run.group(1).split(), "--json"]) == 0
    name = json.loads(capsys.readouterr().out)["name"]
    imports = [b for lang, b in _readme_blocks() if lang == "python" and ".load(" in b]
    assert imports and all(re.search(rf"^import {name} as \w+\b", b, re.M) for b in imports), name
    assert f"generated/{name}/" in (REPO / "README.md").read_text()


def test_readme_cpu_attach_example_runs_without_triton_interpret_set(tmp_path):
    """The README's transformers example, run as a user would on a machine without a GPU:
    a fresh interpreter, TRITON_INTERPRET unset, from the repository root."""
    (block,) = [b for lang, b in _readme_blocks() if lang == "python" and "attach(model" in b and "dist." not in b]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["KVGEN_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", block], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("Once upon a time")
