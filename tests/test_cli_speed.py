"""The CLI answers at once: --help, plan and compile never import torch, triton or transformers (issue 13, item 11).

Each command runs in a fresh interpreter (so nothing an earlier test
imported counts) through a wrapper that calls ``kvgen.cli.main`` and then
reports which heavy modules ``sys.modules`` holds. Every installed plugin
loads, as for a user: a plugin that imports torch at registration fails
this test too. Wall times are measured and reported in issue 13's closing
note; a time limit here would only measure the CI machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers")

WRAPPER = """
import json, sys
report, argv = sys.argv[1], sys.argv[2:]
try:
    from kvgen.cli import main
    code = main(argv)
except SystemExit as exc:  # --help exits through argparse
    code = exc.code
json.dump({"code": code, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in %r)}, open(report, "w"))
""" % (HEAVY + ("sympy", "jinja2", "rich"),)

PLAN = ["--model", "llama-3-8b", "--target", "h100"]


def run_kvgen(tmp_path, argv: list[str]) -> dict:
    report = tmp_path / "report.json"
    env = {**os.environ, "KVGEN_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)  # as a user runs it (tests/conftest.py sets it for this process)
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(report), *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert report.exists(), proc.stderr
    result = json.loads(report.read_text())
    assert result["code"] == 0, proc.stderr
    return {"top": {m.split(".")[0] for m in result["loaded"]}, "stdout": proc.stdout}


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["plan", *PLAN],
    ["plan", *PLAN, "--kv", "int4", "--json"],
    ["compile", *PLAN, "--kv", "int8", "--out", "pkg"],
    ["models"],
    ["targets"],
], ids=["help", "plan-auto", "plan-int4", "compile", "models", "targets"])
def test_light_commands_import_neither_torch_nor_triton_nor_transformers(tmp_path, argv):
    result = run_kvgen(tmp_path, argv)
    assert not result["top"] & set(HEAVY), f"kvgen {' '.join(argv)} imported {sorted(result['top'] & set(HEAVY))}"


def test_help_builds_no_scheme_and_renders_nothing(tmp_path):
    # --help lists commands only: no sympy (0.3 s), no Jinja, no rich.
    result = run_kvgen(tmp_path, ["--help"])
    assert "plan" in result["stdout"] and "compile" in result["stdout"]
    assert not result["top"] & {"sympy", "jinja2", "rich"}, sorted(result["top"])
