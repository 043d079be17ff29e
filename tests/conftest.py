"""Test-wide set-up: kernels run on the Triton CPU interpreter unless a GPU test asks otherwise."""

import os
from pathlib import Path

import pytest

# Must be set before triton is imported anywhere: CPU tests run kernels in the interpreter.
if os.environ.get("KVGEN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"
"""Small real model and text vendored with the tests (see tests/assets/README.md): models/, text/."""


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The vendored assets folder (laid out as models/ and text/); always present in a clone."""
    return ASSETS


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Tests never write into the user's ~/.cache/kvgen.
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvgen-cache"))
