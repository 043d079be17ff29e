"""The engine's kernel language (``kernel_backend``, ``--backend`` of generate/serve): checked before anything
loads, and compiled into a package of its own beside the Triton one."""

from __future__ import annotations

import types

import pytest
import torch

from kvgen.engine.errors import EngineError

from .helpers import STORIES

TINY = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("backend,match", [("cuda", "runs CUDA kernels"), ("auto", "runs the one named"),
                                           ("opencl", "triton or cuda")])
def test_build_engine_refuses_a_backend_it_cannot_run_before_planning(monkeypatch, backend, match):
    import kvgen.integrations.transformers as integration
    from kvgen.engine.loader import build_engine

    def planned(*args, **kw):
        raise AssertionError("build_engine went on to plan the cache")

    monkeypatch.setattr(integration, "plan_for_model", planned)
    with pytest.raises(EngineError, match=match):
        build_engine(config=TINY, device="cpu", verbose=False, kernel_backend=backend)


def test_cli_backend_reaches_the_engine(monkeypatch):
    """``kvgen generate --backend cuda`` hands kernel_backend to the engine (which refuses it on the CPU)."""
    from kvgen.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model, **kwargs):
        seen.update(kwargs)
        raise Stop

    import kvgen.engine.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    with pytest.raises(Stop):
        main(["generate", "--model", str(STORIES), "--prompt", "hi", "--backend", "cuda"])
    assert seen["kernel_backend"] == "cuda"


def test_cuda_and_auto_packages_live_beside_the_triton_one(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from kvgen.integrations.transformers import compile_for_model, plan_for_model

    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path))
    # a shape the CUDA decode serves (head_dim 64, bf16 compute); stories260K's head_dim 8 is not one
    conf = AutoConfig.for_model(**dict(TINY, hidden_size=256, max_position_embeddings=1024))
    shim = types.SimpleNamespace(config=conf, dtype=torch.bfloat16, device=torch.device("cpu"))
    plan = plan_for_model(shim, "int8", device="cpu")
    folders, notes = {}, {}
    for backend in ("triton", "auto"):
        notes[backend] = []
        pkg = compile_for_model(plan, backend, notes[backend])
        folders[backend] = tmp_path / "packages" / (plan.name if backend == "triton" else f"{plan.name}_auto")
        assert (folders[backend] / "manifest.json").is_file(), pkg
    assert not any(p.suffix == ".cu" for p in folders["triton"].rglob("*"))
    assert any(p.suffix == ".cu" for p in folders["auto"].rglob("*"))  # the CUDA decode beside Triton's
    # the notes say which ops stay Triton (prefill has no CUDA template), and decode is not among them
    assert any(n.startswith("prefill stays Triton") for n in notes["auto"]), notes
    assert not any(n.startswith("decode stays Triton") for n in notes["auto"]) and notes["triton"] == []
    from kvgen.codegen.package import BackendError

    with pytest.raises(BackendError, match="one of triton, cuda, auto"):
        compile_for_model(plan, "opencl")
