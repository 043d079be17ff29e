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
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from kvgen import env
from kvgen.codegen.package import import_package  # noqa: F401  (re-exported: kvgen's users import it from here)
from kvgen.errors import KvgenError
from kvgen.integrations.hf_config import text_config
from kvgen.runtime.errors import OutOfPages

ATTN_NAME = "kvgen"
_uids = itertools.count()
_local = threading.local()
_registered = False


class KvgenIntegrationError(KvgenError):
    """The model or the inputs do not fit the kvgen transformers integration."""


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


# --------------------------------------------------------------------------- the cache


class _State:
    """What the per-layer views share with their cache (no reference back to it: no cycles)."""

    def __init__(self) -> None:
        self.seen = 0


class _KvgenLayer(CacheLayerMixin):
    """A per-layer view for code that inspects ``cache.layers``; the pages live in the runtime."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, state: _State) -> None:
        super().__init__()
        self._state = state
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise KvgenIntegrationError("KvgenCache layers are updated through KvgenCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._state.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self._state.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class _Step:
    __slots__ = ("decode", "gather", "batch", "q_len")

    def __init__(self, decode: bool, gather: torch.Tensor | None, batch: int, q_len: int) -> None:
        self.decode, self.gather, self.batch, self.q_len = decode, gather, batch, q_len


class KvgenCache(Cache):
    """A transformers ``Cache`` whose K/V live in a kvgen :class:`~kvgen.runtime.KVCache`.

    One cache holds one batch: row ``b`` is runtime sequence ``(uid, b)``.
    ``get_seq_length()`` counts positions processed (padding included, as
    transformers expects); each sequence in the runtime holds only its real
    tokens. Pages are returned when the cache is reset, released or garbage
    collected. Several KvgenCache objects may share one runtime.
    """

    def __init__(self, runtime: Any) -> None:
        self._state = _State()
        super().__init__(layers=[_KvgenLayer(self._state) for _ in range(runtime.num_layers)])
        self.runtime = runtime
        self._uid = f"hf{next(_uids)}"
        self._gen = 0
        self._seq_ids: list | None = None
        self._step: _Step | None = None
        self._pending: tuple | None = None
        self._finalizer = weakref.finalize(self, _free_all, runtime, [])

    # -- what transformers asks ------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._state.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._state.seen + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._state.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self._seq_ids is None else len(self._seq_ids)

    @property
    def seq_ids(self) -> list:
        """The runtime sequence ids of the batch rows (empty before the first forward)."""
        return list(self._seq_ids or [])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand this layer's new K/V to the ``"kvgen"`` attention function (which writes them)."""
        if self._pending is not None:
            raise KvgenIntegrationError(
                "KvgenCache.update was called again before the attention ran: the model does not use the "
                f"{ATTN_NAME!r} attention implementation; call kvgen.integrations.transformers.attach(model)")
        if layer_idx >= self.runtime.num_layers:
            raise KvgenIntegrationError(
                f"layer {layer_idx} is beyond the runtime's {self.runtime.num_layers} layers; attach the model again")
        self._pending = (layer_idx, key_states, value_states)
        _local.cache = weakref.ref(self)
        return key_states, value_states

    # -- lifetime -----------------------------------------------------------------
    def release(self) -> None:
        """Free this cache's sequences in the runtime (their pages return to the pool)."""
        ids, self._seq_ids = self._seq_ids or [], None
        for sid in ids:
            try:
                self.runtime.free(sid)
            except Exception:  # already freed
                pass
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _free_all, self.runtime, [])
        self._step = None
        self._pending = None

    def reset(self) -> None:
        """Empty the cache (free every sequence); the object can then start a new batch."""
        self.release()
        self._state.seen = 0

    def _set_ids(self, ids: list) -> None:
        self._seq_ids = ids
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _free_all, self.runtime, list(ids))

    def _remap(self, rows: list[int]) -> None:
        """New batch rows: row j continues old row ``rows[j]`` (a copy-on-write fork)."""
        if self._seq_ids is None:
            return
        old = self._seq_ids
        self._gen += 1
        new = [(self._uid, self._gen, j) for j in range(len(rows))]
        for j, i in enumerate(rows):
            self.runtime.fork(old[i], new[j])
        for sid in old:
            self.runtime.free(sid)
        self._set_ids(new)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._remap([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._seq_ids is not None:
            self._remap([i for i in range(len(self._seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        raise KvgenIntegrationError("KvgenCache cannot crop: assisted/speculative decoding is not supported")

    # -- one step ---------------------------------------------------------------------
    def _begin_step(self, batch: int, q_len: int, mask: torch.Tensor | None) -> _Step:
        rt = self.runtime
        if self._seq_ids is None:
            ids = [(self._uid, 0, b) for b in range(batch)]
            for sid in ids:
                rt.add(sid)
            self._set_ids(ids)
        elif len(self._seq_ids) != batch:
            raise KvgenIntegrationError(
                f"this KvgenCache holds a batch of {len(self._seq_ids)}, got {batch} rows; reset() it or use a new cache")
        gather = None
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise KvgenIntegrationError(f"unsupported attention mask of type {type(mask).__name__}; pass a 2-D mask")
        if mask is not None and mask.dim() != 2:
            raise KvgenIntegrationError("kvgen needs the 2-D padding mask; 4-D custom attention masks are not supported")
        if mask is None or q_len == 1:
            counts = [q_len] * batch
        else:
            full = mask.to("cpu", torch.bool)  # one host sync, prefill steps only
            if bool((full[:, 1:] < full[:, :-1]).any()):
                raise KvgenIntegrationError(
                    "right-padded batch: some row has padding after a real token; kvgen supports left padding "
                    "only (tokenizer padding_side='left')")
            new = full[:, -q_len:]
            counts = [int(c) for c in new.sum(1).tolist()]
            if sum(counts) != batch * q_len:
                gather = new.reshape(-1).nonzero().reshape(-1).to(rt.device)
        try:
            rt.plan_step(self._seq_ids, counts)
        except OutOfPages:
            gc.collect()  # caches dropped by earlier generate() calls give their pages back
            rt.plan_step(self._seq_ids, counts)
        self._state.seen += q_len
        self._step = _Step(q_len == 1, gather, batch, q_len)
        return self._step

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """Write this layer's K/V and attend: ``query [B, Hq, T, D]`` -> ``[B, T, Hq, D]``."""
        B, Hq, T, D = query.shape
        rt = self.runtime
        if layer == 0 or self._step is None:
            self._begin_step(B, T, mask)
        step = self._step
        if step.batch != B or step.q_len != T:
            raise KvgenIntegrationError(f"layer {layer} got [{B}, {T}] tokens, the step planned [{step.batch}, {step.q_len}]")
        Hkv = key.shape[1]
        q = query.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if step.decode:
            out = rt.decode(layer, q.reshape(B, Hq, D), None, k.reshape(B, Hkv, D), v.reshape(B, Hkv, D),
                            sm_scale=scaling)
            return out.view(B, 1, Hq, D).to(query.dtype)
        q, k, v = q.reshape(B * T, Hq, D), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D)
        if step.gather is None:
            out = rt.prefill(layer, q, k, v, None, sm_scale=scaling)
            return out.view(B, T, Hq, D).to(query.dtype)
        g = step.gather
        out = rt.prefill(layer, q.index_select(0, g), k.index_select(0, g), v.index_select(0, g), None,
                         sm_scale=scaling)
        full = torch.zeros(B * T, Hq, D, dtype=out.dtype, device=out.device)
        full.index_copy_(0, g, out)
        return full.view(B, T, Hq, D).to(query.dtype)


def _free_all(runtime: Any, ids: list) -> None:
    for sid in ids:
        try:
            runtime.free(sid)
        except Exception:  # already freed, or the runtime is shutting down
            pass


# --------------------------------------------------------------------------- attention


def _take_pending(module: Any, key: torch.Tensor) -> KvgenCache | None:
    ref = getattr(_local, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None or cache._pending is None:
        return None
    layer, k, _ = cache._pending
    if k is not key or layer != getattr(module, "layer_idx", layer):
        return None
    cache._pending = None
    return cache


def _fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """PyTorch SDPA with a causal (+ padding) mask: for forwards without a KvgenCache.

    Key ``j`` is position ``j``; the 2-D mask (if any) covers the first
    ``L`` keys (a static cache may return more, unwritten ones: masked).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if (mask is not None and mask.dim() == 2) or (mask is None and q_len > 1 and kv_len > q_len):
        L = mask.shape[-1] if mask is not None else kv_len
        i = torch.arange(q_len, device=query.device)[:, None] + (L - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        visible = (j <= i) & (j < L)
        if mask is not None:
            pad = torch.zeros(mask.shape[0], kv_len, dtype=torch.bool, device=query.device)
            width = min(L, kv_len)
            pad[:, :width] = mask[:, :width].to(device=query.device, dtype=torch.bool)
            visible = (visible[None] & pad[:, None, :]) | (j == i)[None]  # a padding query sees itself: no NaN
            mask = visible[:, None]
        else:
            mask = visible[None, None]
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def kvgen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"kvgen"`` AttentionInterface function: paged kvgen kernels when the cache is a KvgenCache."""
    cache = _take_pending(module, key)
    if cache is None:
        return _fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if kwargs.get("output_attentions"):
        raise KvgenIntegrationError("output_attentions is not supported by the kvgen attention")
    out = cache.attend(module.layer_idx, query, key, value, attention_mask, scaling)
    return out, None


def kvgen_mask(batch_size: int = 0, q_length: int = 0, kv_length: int = 0, q_offset: int = 0, kv_offset: int = 0,
               mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The ``"kvgen"`` mask function: the 2-D padding mask, unchanged (the kernels are causal by position)."""
    return attention_mask


def register() -> None:
    """Register the ``"kvgen"`` attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kvgen_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvgen_mask)
    _registered = True


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
