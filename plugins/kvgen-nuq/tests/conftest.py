"""Set-up for kvgen-nuq's own tests: kernels run on the Triton CPU interpreter, caches are private."""

import os
from pathlib import Path

import pytest

# Before triton is imported anywhere (kvgen's own tests/conftest.py does the same for its tests).
if os.environ.get("KVGEN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"
"""kvgen's vendored test assets (tests/assets of the checkout this plugin lives in; see its README.md)."""


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvgen-nuq-cache"))


def _asset(relative: str) -> Path:
    # The assets ship with the repository: a missing one is a broken checkout, not a reason to skip.
    path = ASSETS / relative
    if not path.exists():
        pytest.fail(f"test asset {path} is missing; it ships with the kvgen repository (tests/assets)")
    return path


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return _asset("models/stories260K")


@pytest.fixture(scope="session")
def story_text() -> Path:
    return _asset("text/tinystories_valid_first22.txt")
