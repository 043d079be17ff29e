"""Set-up for kvgen-nuq's own tests: kernels run on the Triton CPU interpreter, caches are private."""

import os
from pathlib import Path

import pytest

# Before triton is imported anywhere (kvgen's own tests/conftest.py does the same for its tests).
if os.environ.get("KVGEN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
"""``../shared/data`` next to the kvgen checkout this plugin lives in (plugins/kvgen-nuq/tests)."""


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvgen-nuq-cache"))


@pytest.fixture(scope="session")
def stories260k() -> Path:
    path = SHARED_DATA / "models" / "stories260K"
    if not (path / "config.json").is_file():
        pytest.skip(f"stories260K not found at {path}")
    return path


@pytest.fixture(scope="session")
def story_text() -> Path:
    path = SHARED_DATA / "text" / "tinystories_valid_first22.txt"
    if not path.is_file():
        pytest.skip(f"calibration text not found at {path}")
    return path
