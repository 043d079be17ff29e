"""benchmarks/serve_load.py measures the server, not itself: its workloads and a smoke run on the CPU.

The H200 numbers of issue 15 come from this script; two of its earlier
flaws were in the load generator (repeated prompts hit the prefix cache;
one shared connection pool delayed the first requests), so the properties
that rule them out are tested here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _serve_load():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import serve_load
    finally:
        sys.path.remove(str(ROOT))
    return serve_load


def test_timed_runs_share_lengths_but_no_page_of_prompt():
    sl = _serve_load()
    runs = [sl.workload(40, seed=64, prompt=(20, 60), output=(3, 9), vocab=512, run=k) for k in range(4)]
    assert all([(len(p), m) for p, m in r] == [(len(p), m) for p, m in runs[0]] for r in runs)
    # no two runs' prompts share a leading 16-token page: nothing can be a prefix-cache hit across runs
    heads = [{tuple(p[:16]) for p, _ in r} for r in runs]
    for i in range(len(heads)):
        for j in range(i):
            assert not heads[i] & heads[j]
    assert sl.workload(40, seed=64, prompt=(20, 60), output=(3, 9), vocab=512, run=2) == runs[2]  # seeded


def test_smoke_run_serves_every_request_and_plots(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    run = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", "--smoke", "--out", str(out), "--png",
                          str(png)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    got = {(r["kind"], r["clients"]): r for r in doc["records"]}
    assert doc["kernel_backend"] == "auto"  # the backend the engine was asked for (the default), recorded
    assert set(got) == {(k, c) for k in ("offline", "served") for c in (1, 4)}
    for c in (1, 4):
        served, offline = got["served", c], got["offline", c]
        assert served["failed"] == 0 and served["requests"] == offline["requests"] == 2 * c
        assert served["tokens_per_s"] > 0 and offline["tokens_per_s"] > 0
        assert served["http_overhead"] == pytest.approx(1 - served["tokens_per_s"] / offline["tokens_per_s"])
        assert 0 < served["ttft_p50_ms"] <= served["ttft_p99_ms"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
    else:
        assert png.stat().st_size > 10_000
    # --plot reproduces the run's table from the file
    again = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", "--plot", str(out), "--png",
                            str(tmp_path / "again.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode in (0, 1), again.stderr[-2000:]  # 1: no matplotlib, the table is still printed
    assert again.stdout.count("served") == 2
