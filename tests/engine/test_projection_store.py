"""The chooser's remembered decisions (kvgen.engine.projection_store), on the CPU: what is kept, under which key,
and what is not trusted."""

from __future__ import annotations

import json

import pytest
import torch

from kvgen.engine import projection_store as ps
from kvgen.engine import small_gemm
from kvgen.runtime.autotune import Autotuner

CONSTANTS = {"CONFIGS": ("a", "b"), "LIMIT": 0.004}


def _store(tmp_path, **kw) -> ps.ProjectionStore:
    return ps.ProjectionStore(Autotuner("cpu", directory=tmp_path, progress=False, **kw), CONSTANTS)


@pytest.mark.parametrize("choice", [None, 0, 3, small_gemm.Config(64, 128, 2, 4, 6)])
def test_a_choice_survives_the_file_and_a_new_process(tmp_path, choice):
    key = ps.key("o", (4096, 4096), torch.bfloat16, False, 32, True)
    _store(tmp_path).remember(key, choice, 0.0139, None if choice is None else 0.0111)
    got, cublas_ms, ours = _store(tmp_path).recall(key)  # a fresh tuner reads the file
    assert got == choice and type(got) is type(choice)
    assert cublas_ms == 0.0139 and ours == (None if choice is None else 0.0111)


def test_keys_separate_what_a_decision_depends_on():
    keys = {ps.key(n, s, d, b, r, p) for n in ("o", "qkv") for s in ((4096, 4096), (6144, 4096))
            for d in (torch.bfloat16, torch.float16) for b in (False, True) for r in (16, 32) for p in (False, True)}
    assert len(keys) == 2 ** 6


def test_nothing_is_recalled_without_a_tuner_in_mode_off_or_under_another_identity(tmp_path, monkeypatch):
    key = ps.key("qkv", (6144, 4096), torch.bfloat16, False, 1, True)
    _store(tmp_path).remember(key, 2, 0.015, 0.0135)
    assert ps.ProjectionStore(None, CONSTANTS).recall(key)[0] is ps.MISSING
    assert _store(tmp_path, mode="off").recall(key)[0] is ps.MISSING
    other = ps.ProjectionStore(Autotuner("cpu", directory=tmp_path, progress=False), {**CONSTANTS, "LIMIT": 0.005})
    assert other.khash != _store(tmp_path).khash and other.recall(key)[0] is ps.MISSING
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch: cuBLAS may decide otherwise
    assert _store(tmp_path).recall(key)[0] is ps.MISSING


@pytest.mark.parametrize("config", [{"kernel": "gemv"}, {"kernel": "gemv", "index": "2"},
                                    {"kernel": "gemv", "index": True}, {"kernel": "cublas", "x": 1},
                                    {"kernel": "small_gemm", "block_n": 64}, {"kernel": "tensorrt"}, [], "cublas"])
def test_malformed_entries_are_not_trusted(tmp_path, config):
    store = _store(tmp_path)
    key = ps.key("down", (4096, 14336), torch.bfloat16, False, 2, False)
    store.remember(key, 1, 0.032, 0.031)
    path = next((tmp_path / "autotune").glob("projections-*.json"))
    data = json.loads(path.read_text())
    data["entries"][key]["config"] = config
    path.write_text(json.dumps(data))
    assert _store(tmp_path).recall(key)[0] is ps.MISSING
    data["entries"][key] = {"config": {"kernel": "gemv", "index": 1}, "cublas_ms": "fast", "ms": 0.03}
    path.write_text(json.dumps(data))
    assert _store(tmp_path).recall(key)[0] is ps.MISSING


def test_an_entry_without_a_config_dict_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config"):
        Autotuner("cpu", directory=tmp_path, progress=False).remember("x" * 8, "projection/k", {"config": 3})
