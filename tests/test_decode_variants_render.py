"""benchmarks.experiments.decode_variants render: the sources it writes for the device's head-to-head timing."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.experiments import decode_variants as dv

has_git = shutil.which("git") is not None and subprocess.run(
    ["git", "-C", str(dv.REPO), "rev-parse", "HEAD"], capture_output=True).returncode == 0


def test_variant_names_keep_a_revision_readable_in_a_file_name():
    assert dv.variant_name("candidate/bt-pointer") == "candidate_bt-pointer"
    assert dv.variant_name("HEAD~1") == "HEAD_1"
    assert dv.variant_name("v1.2") == "v1.2"


@pytest.mark.skipif(not has_git, reason="needs the repository's git history")
def test_revisions_render_as_named_variants_beside_the_base(tmp_path):
    dv.render(tmp_path, ["int8"], "HEAD", revs=("HEAD",))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["int8--HEAD.cu", "int8--base.cu", "int8--tree.cu"]
    # the same revision renders the same kernel, whichever role it has
    assert (tmp_path / "int8--HEAD.cu").read_text() == (tmp_path / "int8--base.cu").read_text()
    assert "decode_kernel" in (tmp_path / "int8--HEAD.cu").read_text()
