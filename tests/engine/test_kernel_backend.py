"""The engine's kernel language (``kernel_backend``, ``--backend`` of generate/serve): checked before anything
loads, and compiled into a package of its own beside the Triton one; ``auto`` lets the runtime decide the decode
kernel at start (Triton off a GPU), and tp ranks run rank 0's decision."""

from __future__ import annotations

import types

import pytest
import torch

from kvgen.engine.errors import EngineError

from .helpers import STORIES

TINY = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("backend,match", [("cuda", "runs CUDA kernels"), ("opencl", "triton, cuda or auto")])
def test_build_engine_refuses_a_backend_it_cannot_run_before_planning(monkeypatch, backend, match):
    import kvgen.integrations.transformers as integration
    from kvgen.engine.loader import build_engine

    def planned(*args, **kw):
        raise AssertionError("build_engine went on to plan the cache")

    monkeypatch.setattr(integration, "plan_for_model", planned)
    with pytest.raises(EngineError, match=match):
        build_engine(config=TINY, device="cpu", verbose=False, kernel_backend=backend)


def test_check_kernel_backend_says_what_runs_where():
    from kvgen.engine.loader import check_kernel_backend

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [check_kernel_backend(b, gpu) for b in ("triton", "cuda", "auto")] == ["triton", "cuda", "auto"]
    assert check_kernel_backend("triton", cpu) == check_kernel_backend("auto", cpu) == "triton"  # no nvcc off a GPU
    with pytest.raises(EngineError, match="the cuda kernel backend runs CUDA kernels; the engine is on cpu: use "
                                          "--backend auto"):
        check_kernel_backend("cuda", cpu)
    for bad in ("opencl", "Auto", None):
        with pytest.raises(EngineError, match=f"kernel backend must be triton, cuda or auto, got {bad!r}"):
            check_kernel_backend(bad, gpu)


def test_auto_on_rocm_is_triton(monkeypatch):
    """ROCm's devices are "cuda" too; nvcc's kernels cannot run there, so auto compiles Triton only."""
    from kvgen.engine.loader import check_kernel_backend

    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    gpu = torch.device("cuda", 0)
    assert check_kernel_backend("auto", gpu) == "triton" and check_kernel_backend("cuda", gpu) == "cuda"


@pytest.mark.parametrize("backend", ["cuda", "triton", "auto", None])
def test_cli_backend_reaches_the_engine(monkeypatch, backend):
    """``kvgen generate --backend cuda|triton|auto`` hands kernel_backend to the engine (which decides what
    runs); without the flag it is auto, as build_engine's default."""
    import inspect

    from kvgen.engine.loader import build_engine
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
        main(["generate", "--model", str(STORIES), "--prompt", "hi"] + (["--backend", backend] if backend else []))
    assert seen["kernel_backend"] == (backend or "auto")
    assert inspect.signature(build_engine).parameters["kernel_backend"].default == "auto"


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


def greedy(llm, prompts, n_tokens=4):
    from kvgen.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_tokens, min_tokens=n_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_auto_on_the_cpu_runs_triton_and_compiles_no_cuda(monkeypatch):
    """Off a GPU ``auto`` is ``triton``: the Triton package (no CUDA variant, no nvcc), the Triton engine's tokens."""
    pytest.importorskip("transformers")
    import kvgen.integrations.transformers as integration
    from kvgen.engine.llm import LLM

    compiled = []
    compile_for_model = integration.compile_for_model

    def recorded(plan, backend="triton", notes=None):
        compiled.append(backend)
        return compile_for_model(plan, backend, notes)

    monkeypatch.setattr(integration, "compile_for_model", recorded)
    prompts = ["Once upon a time", "Lily"]
    small = dict(kv="fp32", max_tokens=256, max_model_len=64, max_num_seqs=2, verbose=False)
    outs = {}
    for backend in ("triton", "auto"):
        with LLM(str(STORIES), kernel_backend=backend, **small) as llm:
            cache = llm.engine.cache
            assert cache.kernel_backends["decode"] == "triton" and list(cache.kernel_variants["decode"]) == ["triton"]
            outs[backend] = greedy(llm, prompts)
    assert compiled == ["triton", "triton"]
    assert outs["auto"] == outs["triton"] and all(len(t) == 4 for t in outs["auto"])


# a shape the CUDA decode serves (head_dim 64), so an auto package holds both decode kernels
AUTO_SHAPE = dict(TINY, hidden_size=256, max_position_embeddings=1024)


def test_an_auto_package_says_which_decode_kernel_runs(monkeypatch, capsys):
    """The auto path of build_engine, on the CPU (check_kernel_backend bypassed): both decode kernels are loaded,
    Triton runs (nothing is timed here) and the summary says so and why."""
    pytest.importorskip("transformers")
    from kvgen.engine import loader

    monkeypatch.setattr(loader, "check_kernel_backend", lambda backend, device: backend)
    eng = loader.build_engine(config=AUTO_SHAPE, kv="int8", dtype="bfloat16", device="cpu", max_num_seqs=2,
                              max_tokens=1024, kernel_backend="auto")
    cache = eng.cache
    assert list(cache.kernel_variants["decode"]) == ["triton", "cuda"] and cache.kernel_backends["decode"] == "triton"
    choice = cache.backend_choices["decode"]
    assert choice.origin == "first"
    assert f"kvgen: decode kernel: {choice.why}\n" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_tp_ranks_run_rank_0s_decode_kernel(monkeypatch, backend):
    """A worker loads the same auto package with each op pinned to rank 0's choice (RankSpec.kernel_choice),
    whatever it would have chosen alone."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from kvgen.engine.config import ModelConfig
    from kvgen.engine.parallel import RankSpec, load_cache
    from kvgen.integrations.transformers import compile_for_model, plan_for_model

    shim = types.SimpleNamespace(config=AutoConfig.for_model(**AUTO_SHAPE), dtype=torch.bfloat16,
                                 device=torch.device("cpu"))
    plan = plan_for_model(shim, "int8", device="cpu")
    package = compile_for_model(plan, "auto")
    choice = {op: "triton" for op in package.KERNELS} | {"decode": backend}
    spec = RankSpec(world=1, store="", backend="gloo", device_type="cpu", cfg=ModelConfig.from_dict(AUTO_SHAPE),
                    plan=plan, folder=None, seed=0, dtype=torch.bfloat16, max_tokens=1024, cache_seqs=2,
                    autotune=False, max_model_len=256, max_num_seqs=2, use_graphs=False, kernel_backend="auto",
                    kernel_choice=choice)
    cache = load_cache(spec, 0)
    assert cache.kernel_backends == choice
    assert cache.kernels["decode"] is package.KERNEL_VARIANTS["decode"][backend]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_a_gpu_times_the_decode_kernels_once_and_generates_triton_tokens(capsys):
    """``kernel_backend="auto"`` on a GPU: the runtime times both decode kernels at start (or reuses the choice
    a previous start persisted), says so, and the engine's greedy tokens are the Triton engine's (up to bf16
    near ties, as the CUDA and Triton kernels round differently)."""
    import os
    import random

    from kvgen.engine import SamplingParams
    from kvgen.engine.loader import build_engine

    from .test_gpu import TINY as GPU_TINY
    from .test_gpu import assert_same_until_a_near_tie, run_with_logprobs

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs compiled (not interpreted) kernels: nothing is timed under the interpreter")
    rng = random.Random(1)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(8, 200))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=3)
    common = dict(config=GPU_TINY, kv="int8", dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=8,
                  max_tokens=8192)
    auto = build_engine(kernel_backend="auto", verbose=True, **common)
    first = auto.cache.backend_choices["decode"]
    assert list(auto.cache.kernel_variants["decode"]) == ["triton", "cuda"]
    assert first.origin in ("timed", "remembered"), first
    assert auto.cache.kernel_backends["decode"] == first.backend
    assert f"kvgen: decode kernel: {first.why}" in capsys.readouterr().err
    got = run_with_logprobs(auto, prompts, params)
    assert auto.runner.graph_steps > 0
    triton = build_engine(kernel_backend="triton", verbose=False, **common)
    assert_same_until_a_near_tie(got, run_with_logprobs(triton, prompts, params))
    again = build_engine(kernel_backend="auto", verbose=False, **common).cache.backend_choices["decode"]
    assert again.backend == first.backend
    if len(first.ms) == 2:  # both kernels ran: the choice was persisted, the next start reuses it
        assert again.origin == "remembered", again
