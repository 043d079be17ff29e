"""KvgenCache: a transformers ``Cache`` whose K/V live in a kvgen runtime (one batch per cache).

``KvgenCache(runtime)`` wraps a loaded :class:`~kvgen.runtime.KVCache`. Its
``update`` stores nothing: it parks the layer's new K/V for the ``"kvgen"``
attention function (:mod:`.hf_attention`), which takes them back with
:func:`_take_pending` (same thread, same key tensor, same layer) and calls
:meth:`KvgenCache.attend`. There the first layer of a step plans it for all
layers (``KVCache.plan_step``, after checking the 2-D padding mask: left
padding only), and every layer writes its K/V into the pages and attends
with the prefill or the decode kernel. Beam search and
``num_return_sequences`` fork sequences copy-on-write; pages go back to the
runtime on ``reset``/``release`` or when the cache is garbage collected.
:class:`KvgenIntegrationError` is what the whole integration raises for a
model or inputs it cannot serve.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvgen.errors import KvgenError
from kvgen.runtime.errors import OutOfPages

ATTN_NAME = "kvgen"  # the attention and mask functions' name in transformers; attach switches the model to it
_uids = itertools.count()
_local = threading.local()  # .cache: the cache whose update ran last on this thread (the attention takes its K/V)


class KvgenIntegrationError(KvgenError):
    """The model or the inputs do not fit the kvgen transformers integration."""


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


def _take_pending(module: Any, key: torch.Tensor) -> KvgenCache | None:
    """The KvgenCache whose ``update`` handed over ``key`` for ``module``'s layer, its pending K/V now taken.

    None when this thread's last updated cache is gone, has nothing pending,
    or parked another tensor or layer: the forward runs without a KvgenCache.
    """
    ref = getattr(_local, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None or cache._pending is None:
        return None
    layer, k, _ = cache._pending
    if k is not key or layer != getattr(module, "layer_idx", layer):
        return None
    cache._pending = None
    return cache
