"""Run Hugging Face ``generate()`` on kvgen pages and kernels.

``attach(model, scheme="int8")`` plans a KV cache for ``model.config``
(the ``cpu`` target preset on the CPU, the detected GPU on CUDA; compute
dtype = the model's dtype), compiles the plan into the cache directory
(``<cache_dir>/packages/<plan name>``, a no-op when already compiled),
imports the generated package, loads its runtime, and switches the model's
attention implementation to ``"kvgen"``. Afterwards a plain
``model.generate(...)`` creates a :class:`KvgenCache` instead of a
``DynamicCache``; the cache ``attach`` returns can also be passed as
``past_key_values=`` / ``cache=``.

How a forward pass runs (Llama, Mistral, Qwen2 and other models whose
attention calls ``cache.update(...)`` and then the ``AttentionInterface``
function):

- ``KvgenCache.update`` stores nothing itself: it hands this layer's new
  K/V (after RoPE) to the attention function, which has the query and the
  padding mask.
- The attention function of the first layer plans the step
  (``KVCache.plan_step``: one host-side plan for all layers); every layer
  then writes its K/V into the pages (cache-write kernel, plus copy-on-write
  and page conversions) and attends with the prefill kernel (several new
  tokens) or the decode kernel (one new token per sequence). The prefill
  kernel gets the step's K/V too (``KVCache.prefill(layer, q, k, v)``, rows
  aligned with q, padding rows dropped from both alike) and attends the
  step's own tokens from them exactly, only earlier tokens from the pages;
  the decode kernel reads everything, the new token included, from the pages.
- The mask function registered for ``"kvgen"`` passes the 2-D padding mask
  through unchanged, so the attention function knows which tokens are
  padding.

Padding: left-padded batches are supported (chunked prefill included).
Padding tokens are never written to the cache, so each row's sequence holds
only its real tokens (exactly what HF's masked attention sees); padding
query rows return zeros. A mask with padding after a real token (right
padding) is rejected with :class:`KvgenIntegrationError`. During decode (one
new token per row) the mask is not inspected (no host sync), as
``generate`` only appends real tokens.

Not supported: assisted/speculative decoding (``crop``), 4-D custom masks,
``output_attentions``. Beam search and ``num_return_sequences`` work
through ``reorder_cache``/``batch_repeat_interleave`` (copy-on-write forks).
Without a KvgenCache (``use_cache=False``, or another cache type) the
``"kvgen"`` attention falls back to PyTorch SDPA.

This module plans and compiles a cache for a model and attaches it; the
cache class is :mod:`.hf_cache`'s and the attention and mask functions are
:mod:`.hf_attention`'s (their names are importable from here too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from kvgen import env
from kvgen.codegen.package import import_package  # noqa: F401  (re-exported: kvgen's users import it from here)
from kvgen.integrations.hf_attention import kvgen_attention, kvgen_mask, register  # noqa: F401  (re-exported)
from kvgen.integrations.hf_cache import ATTN_NAME, KvgenCache, KvgenIntegrationError
from kvgen.integrations.hf_config import text_config


# --------------------------------------------------------------------------- planning


def model_spec(config: Any, name: str | None = None):
    """A kvgen ModelSpec from a transformers config object."""
    from kvgen.models import spec_from_config

    text = text_config(config)
    raw = {k: v for k, v in text.to_dict().items() if v is not None}
    if name is None:
        name = Path(str(getattr(config, "_name_or_path", "") or "")).name or getattr(text, "model_type", "model")
    return spec_from_config(raw, name=name, source=f"{name} (model.config)", hf=text)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in ("float32", "float16", "bfloat16"):
        raise KvgenIntegrationError(f"model dtype {dtype} is not supported; use float32, float16 or bfloat16")
    return name


def plan_for_model(model: Any, scheme: str = "int8", *, device: torch.device | str | None = None,
                   target: str | None = None, context: int | None = None, concurrency: int = 1,
                   page_size: int | None = None, tp: int = 1):
    """The kvgen Plan for ``model`` (its config and dtype) on ``target``, sharded over ``tp`` ranks.

    ``target`` defaults to the ``cpu`` preset for a CPU device and to the
    detected GPU for CUDA; ``context`` to the model's max positions.
    """
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import detect_target, resolve_target

    device = torch.device(device) if device is not None else model.device
    spec = model_spec(model.config)
    if target is not None:
        tgt = resolve_target(target)
    elif device.type == "cuda":
        tgt = detect_target()
    else:
        tgt = resolve_target("cpu")
    workload = Workload(context=int(context or spec.max_positions), concurrency=int(concurrency),
                        compute_dtype=_dtype_name(model.dtype), page_size=page_size, tp=int(tp))
    return make_plan(spec, tgt, workload, default_registry().schemes, kv=scheme)


def compile_for_model(plan, backend: str = "triton", notes: list[str] | None = None) -> Any:
    """Compile ``plan`` into ``<cache_dir>/packages/<plan name>`` (no-op when unchanged) and import it.

    ``backend``: the kernel language, as ``kvgen compile --backend`` (a cuda or auto package lives beside the
    Triton one, ``<plan name>_<backend>``, so switching never rewrites a package another process may use).
    ``notes``: a list that receives the compiler's notes (which ops stay Triton and why; nvcc skipped).
    """
    from kvgen.codegen.package import check_backend, compile_plan

    check_backend(backend)

    root = env.cache_dir()
    try:
        (root / "packages").mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # KVGEN_CACHE_DIR names a file, or a folder kvgen may not write
        raise KvgenIntegrationError(
            f"cannot keep compiled packages under the cache folder {root} ({exc.strerror or exc}); set KVGEN_CACHE_DIR "
            "to a writable folder (or unset it for ~/.cache/kvgen)") from None
    name = plan.name if backend == "triton" else f"{plan.name}_{backend}"
    result = compile_plan(plan, out_dir=root / "packages" / name, backend=backend)
    if notes is not None:
        notes.extend(result.notes)
    return import_package(result.out_dir)

# --------------------------------------------------------------------------- attach


def _hook_generate(model: Any, runtime: Any) -> None:
    original = model._prepare_cache_for_generation

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        result = original(generation_config, model_kwargs, *args, **kwargs)
        # transformers >= 5.24 keeps generate()'s cache under "cache", earlier 5.x under "past_key_values":
        # replacing only one name would let generate() run silently on its own cache.
        for key in ("cache", "past_key_values"):
            cache = model_kwargs.get(key)
            if type(cache) is DynamicCache and generation_config.cache_implementation in (None, "dynamic"):
                model_kwargs[key] = KvgenCache(runtime)
        return result

    model._prepare_cache_for_generation = prepare
    model._kvgen_original_prepare = original


def attach(model: Any, scheme: str = "int8", max_tokens: int | None = None,
           device: torch.device | str | None = None, *, target: str | None = None, context: int | None = None,
           concurrency: int = 1, page_size: int | None = None, autotune: bool = True,
           max_seqs: int | None = None, tp_rank: int | None = None, tp_size: int | None = None) -> KvgenCache:
    """Make ``model.generate(...)`` run on kvgen pages and kernels; returns a fresh :class:`KvgenCache`.

    ``scheme``: a kvgen scheme (``fp32``, ``fp16``, ``bf16``, ``int8``,
    ``fp8``, ``int4``, ``int2``, or a plugin's), optionally with options
    as on the command line (``"int4:residual=64"``, ``"nuq4:codebook=F"``;
    see :func:`kvgen.schemes.resolve_scheme`). ``max_tokens``: tokens of pages to
    allocate, shared by every KvgenCache of this model (default: the
    workload's ``context * concurrency``, at least 16384, at most the plan's
    capacity). ``device``: default the model's device. ``target``: a kvgen
    target preset (default ``cpu`` on the CPU, the detected GPU on CUDA).
    ``context``/``concurrency``/``page_size`` go to the planner. Calling it
    again replaces the previous attachment. ``tp_rank``/``tp_size``: this
    process's tensor-parallel shard, for a model already cut with
    ``kvgen.integrations.tensor_parallel.shard_model`` (the plan is made for
    the whole model with ``--tp tp_size``; the runtime holds this rank's KV heads).
    Both default to what ``shard_model`` recorded on the model (0 and 1 for an
    unsharded model); values that contradict it raise KvgenIntegrationError.
    """
    sharded = getattr(model, "_kvgen_tp", None)
    if sharded is not None and (tp_rank, tp_size) != (None, None) and \
            (tp_rank, tp_size) != (sharded["rank"], sharded["world_size"]):
        raise KvgenIntegrationError(
            f"the model was sharded for rank {sharded['rank']} of {sharded['world_size']}, not rank {tp_rank} of "
            f"{tp_size}; pass tp_rank={sharded['rank']}, tp_size={sharded['world_size']} (or neither)")
    if tp_rank is None:
        tp_rank = sharded["rank"] if sharded else 0
    if tp_size is None:
        tp_size = sharded["world_size"] if sharded else 1
    if getattr(model, "_kvgen", None) is not None:
        detach(model)
    register()
    device = torch.device(device) if device is not None else model.device
    plan = plan_for_model(model, scheme, device=device, target=target, context=context,
                          concurrency=concurrency, page_size=page_size, tp=tp_size)
    package = compile_for_model(plan)
    if max_tokens is None:
        max_tokens = min(plan.capacity_tokens, max(plan.context * plan.concurrency, 16384))
    runtime = package.load(device=device, max_tokens=max_tokens, autotune=autotune,
                           max_seqs=max_seqs if max_seqs is not None else max(4, concurrency),
                           tp_rank=tp_rank, tp_size=tp_size)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise KvgenIntegrationError(
            f"{type(model).__name__} does not accept a custom attention implementation (AttentionInterface)")
    _hook_generate(model, runtime)
    model._kvgen = {"plan": plan, "package": package, "runtime": runtime, "previous_attn": previous}
    return KvgenCache(runtime)


def detach(model: Any) -> None:
    """Undo :func:`attach`: the model's previous attention implementation and default cache again."""
    info = getattr(model, "_kvgen", None)
    if info is None:
        return
    original = model.__dict__.pop("_kvgen_original_prepare", None)
    model.__dict__.pop("_prepare_cache_for_generation", None)
    del original
    model.set_attn_implementation(info["previous_attn"] or "sdpa")
    model._kvgen = None


def runtime_of(model: Any):
    """The kvgen runtime (KVCache) attached to ``model``, or None."""
    info = getattr(model, "_kvgen", None)
    return None if info is None else info["runtime"]
