"""One engine-process server per test session (per xdist worker), shared by the modules that serve the stand-in.

Starting an engine process costs seconds (a fresh interpreter imports
torch and builds the engine), so test_api's and test_load's process-mode
runs share this one: sized for test_load's 100 clients, its steps slowed
down per test with ``on_engine(set_delay, s)``. Tests that count metrics on
it count differences. At the end nothing may be left in the engine.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def process_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from .helpers import ServerThread, table_spec

    with ServerThread(table_spec(max_num_seqs=128, max_tokens=1 << 15)) as s:
        yield s
    assert s.summary == {"requests": 0, "pages_used": 0, "sequences": 0}
