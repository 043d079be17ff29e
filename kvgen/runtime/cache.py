"""KVCache: the paged KV cache of one plan, its page pools, and the attention ops over it.

Usage, once per model step (FlashInfer-style plan/run split)::

    cache = load(PLAN, KERNELS, device="cuda")
    cache.add("a", prompt_ids)                  # -> tokens already cached (prefix hit)
    step = cache.plan_step(["a"], [len(prompt_ids)], token_ids=[prompt_ids])
    for layer in range(num_layers):             # no host sync in here
        out = cache.prefill(layer, q, k, v, ["a"])      # q [total, Hq, D], k/v [total, Hkv, D]
    cache.plan_step(["a"], [1])
    for layer in range(num_layers):
        cache.append_kv(layer, ["a"], k, v)     # k/v [B, Hkv, D]
        out = cache.decode(layer, q, ["a"])     # q [B, Hq, D]

``plan_step`` does all host work: it reserves slots in the block manager (all
sequences or none: :class:`OutOfPages` leaves everything unchanged), and
uploads block tables, lengths, slot mapping, copy-on-write copies and page
conversions once. Per layer, ``append_kv`` runs the copies (page_copy),
then the cache write, then the conversions (page_quantize: a residual page
that filled is quantized into its compressed page), all from that
metadata (a long append to a residual scheme may take a few such phases,
see ``BlockManager.reserve_step``); ``decode``/``prefill`` then read the cache. Run every layer of a
step before planning the next one: the next plan may reuse pages the
current step's conversions still have to read. Freeing a sequence of the
planned step makes the step unusable (its pages may be handed out again).

Which keys come from where: ``prefill(layer, q, k, v)`` writes the chunk's
K/V into the pages *and* hands the same k/v to the kernel, which attends the
chunk's own tokens exactly (compute dtype, as serving systems do) and only
the earlier tokens (the cached prefix) from the pages; the pages keep the
chunk in the scheme's format for later steps. ``prefill(layer, q, None,
None)`` after ``append_kv`` reads every key from the pages, chunk included,
and ``decode`` always reads the whole history, the new token too, from the
pages (given k and v, a page the step converts from its residual copy,
before the conversion: :mod:`.preconversion`).

This module holds the cache's sequences, step planning and per-layer ops,
and :func:`load`; the host tier's operations are in :mod:`.cache_tier`, the
kernel checks and launch-config choice (autotuning) in :mod:`.cache_kernels`,
reading a sequence's KV back (tests, debugging) in :mod:`.cache_inspect`.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from .autotune import Autotuner
from .block_manager import COMPRESSED, RESIDUAL, BlockManager
from .cache_kernels import REQUIRED_OPS, KernelConfigMixin, _check_kernels_can_run, _variants
from .cache_inspect import InspectionMixin
from .cache_tier import HostTierMixin
from .errors import KvgenRuntimeError, seq_id_list
from .page_pool import PagePool, _indexed, default_device, pool_sizes
from .preconversion import pre_conversion_view
from .step import DeviceBuffers, StepMetadata, build_step


class KVCache(HostTierMixin, KernelConfigMixin, InspectionMixin):
    """The runtime of one generated plan: page pools, block manager, kernels, step metadata.

    Construct through :func:`load` (or a generated package's ``load()``).
    Attributes: ``plan`` (plan.json as a dict), ``kernels`` (op -> the module
    that runs), ``kernel_variants`` (op -> backend -> module: what ``variants=``
    gave, the first being ``kernels``' default), ``kernel_backends`` (op ->
    the backend that runs) and ``backend_choices`` (op -> why, for ops with
    several variants; :mod:`.backend_choice` chooses at construction),
    ``device``, ``dtype`` (compute dtype), ``num_layers``, ``page_size``,
    ``num_kv_heads``/``num_q_heads`` (this rank's), ``head_dim``,
    ``num_pages``/``num_residual_pages``, ``block_manager``, ``page_pool``
    (:class:`PagePool`) and ``pools`` (its per-layer dicts, as kernels take them),
    ``step`` (the current :class:`StepMetadata`), ``autotuner``, ``host_tier``
    (a :class:`~.host_tier.HostTier`, or None).

    Host tier (``host_tokens=N``, or ``"plan"`` for the plan's
    ``host_tier_bytes``): pages in host memory (pinned on CUDA) in the
    scheme's own format. :meth:`swap_out`/:meth:`swap_in` move whole
    sequences (preemption by swap); :meth:`make_cold` keeps a sequence's
    oldest pages on the host, staged into a device ring of two slots of
    ``staging_tokens`` each (extra device memory; default: a quarter of one
    layer's pages, at most the host tier's size; a step's cold pages must
    fit one slot) one layer ahead of the attention that reads them; prefix-cache
    pages the LRU evicts spill to the host and come back on a later hit
    (:meth:`add`). Without a host tier none of this costs anything.

    Sequence ids are any hashable values. Errors a caller can cause are
    :class:`KvgenRuntimeError` subclasses (``OutOfPages``, ``UnknownSequence``).
    """

    def __init__(self, plan: Mapping[str, Any], kernels: Mapping[str, ModuleType], *,
                 device: torch.device | str | None = None, max_tokens: int | None = None,
                 num_layers: int | None = None, dtype: torch.dtype | str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, autotune: bool = True,
                 autotuner: Autotuner | None = None, max_seqs: int | None = None,
                 zero: bool = False, host_tokens: int | str | None = None,
                 staging_tokens: int | None = None,
                 variants: Mapping[str, Mapping[str, ModuleType]] | None = None) -> None:
        self.plan = dict(plan)
        missing = [op for op in REQUIRED_OPS if op not in kernels]
        self.residual_tokens = (self.plan.get("scheme_params") or {}).get("residual_tokens")
        if self.residual_tokens is not None and "page_quantize" not in kernels:
            missing.append("page_quantize")
        if missing:
            raise KvgenRuntimeError(f"kernels lack the ops {missing}; recompile the plan (kvgen compile)")
        self.kernels = dict(kernels)
        self.kernel_variants = _variants(self.kernels, variants)
        self.device = _indexed(torch.device(device)) if device is not None else default_device()
        _check_kernels_can_run(self.device, self.kernels)
        self.dtype = getattr(torch, self.plan["compute_dtype"])
        if dtype is not None:
            want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            if want != self.dtype:
                raise KvgenRuntimeError(
                    f"the plan's kernels are compiled for {self.plan['compute_dtype']}, not {want}; "
                    f"plan and compile with --dtype matching the model")
        plan_tp = int(self.plan.get("tp", 1))
        if tp_size != plan_tp:
            raise KvgenRuntimeError(f"the plan is for tp {plan_tp}, got tp_size {tp_size}; plan with --tp {tp_size}")
        if not 0 <= tp_rank < tp_size:
            raise KvgenRuntimeError(f"tp_rank must be in 0..{tp_size - 1}, got {tp_rank}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        total_layers = int(self.plan["num_layers"])
        self.num_layers = total_layers if num_layers is None else int(num_layers)
        if not 1 <= self.num_layers <= total_layers:
            raise KvgenRuntimeError(f"num_layers must be in 1..{total_layers}, got {num_layers}")
        self.page_size = int(self.plan["page_size"])
        self.num_kv_heads = int(self.plan["kv_heads_per_gpu"])
        self.num_q_heads = int(self.plan["q_heads_per_gpu"])
        self.head_dim = int(self.plan["head_dim"])
        self.scheme = self.plan["scheme"]
        self.sm_scale = self.head_dim ** -0.5
        self.num_pages, self.num_residual_pages = pool_sizes(self.plan, max_tokens, max_seqs)
        host_pages, host_residual, staging = self._host_sizes(host_tokens, staging_tokens)

        self.page_pool = PagePool(self.plan["page_tensors"], num_layers=self.num_layers, num_pages=self.num_pages,
                                  num_residual_pages=self.num_residual_pages, num_kv_heads=self.num_kv_heads,
                                  page_size=self.page_size, head_dim=self.head_dim, dtype=self.dtype,
                                  device=self.device, residual=self.residual_tokens is not None, zero=zero,
                                  staging_pages=staging)
        self.pools = self.page_pool.layers
        self.block_manager = BlockManager(self.page_size, self.num_pages, self.num_residual_pages,
                                          self.residual_tokens, scheme_name=self.scheme,
                                          num_host_pages=host_pages, num_host_residual_pages=host_residual)
        self.host_tier = None
        if host_pages:
            from .host_tier import HostTier
            self.host_tier = HostTier(self.page_pool, host_pages, host_residual, self.device)
        self._held: list = []       # (event, ticket): device pages a copy to the host still reads
        self._arrivals: dict = {}   # sequence -> event of the copies that bring its pages to the device
        self.autotuner = autotuner or Autotuner(self.device, enabled=autotune)
        self._buffers = DeviceBuffers(self.device)
        self._steps = 0
        self.step: StepMetadata | None = None
        self._choose_backends()  # last: it may time the variants on this cache's pools (never raises)

    def __repr__(self) -> str:
        bm = self.block_manager
        residual = (f", residual_tokens={self.residual_tokens}, residual pages "
                    f"{bm.num_free_pages(RESIDUAL)}/{self.num_residual_pages} free"
                    if self.residual_tokens is not None else "")
        return (f"KVCache(scheme={self.scheme!r}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"q_heads={self.num_q_heads}, head_dim={self.head_dim}, page_size={self.page_size}, "
                f"compressed pages {bm.num_free_pages(COMPRESSED)}/{self.num_pages} free{residual}, "
                f"sequences={len(bm.sequences())}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"device={self.device}, tp={self.tp_rank}/{self.tp_size})")

    # -- sizes ------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the allocated pages hold (compressed plus residual pool)."""
        return (self.num_pages + self.num_residual_pages) * self.page_size

    def num_free_pages(self) -> int:
        """Device pages an allocation can take now (free or evictable), compressed and residual pools together.

        It grows only when pages are freed (or become evictable); a caller
        that failed to fit work may wait for it to grow before trying again.
        """
        bm = self.block_manager
        return bm.num_free_pages(COMPRESSED) + (bm.num_free_pages(RESIDUAL) if self.num_residual_pages else 0)

    def allocated_bytes(self, pool: str | None = None) -> int:
        """Bytes of page storage over all layers (``pool``: ``"compressed"``/``"residual"`` only)."""
        return self.page_pool.nbytes(pool)

    def kv_head_range(self) -> range:
        """The model's KV heads this tensor-parallel rank holds."""
        rep = int(self.plan.get("kv_replication", 1)) or 1
        start = (self.tp_rank // rep) * self.num_kv_heads
        return range(start, start + self.num_kv_heads)

    def q_head_range(self) -> range:
        """The model's query heads this tensor-parallel rank computes."""
        start = self.tp_rank * self.num_q_heads
        return range(start, start + self.num_q_heads)

    # -- sequences ----------------------------------------------------------
    def add(self, seq_id: Hashable, token_ids: Sequence[int] = ()) -> int:
        """Start a sequence; returns how many leading ``token_ids`` are already cached (a prefix hit).

        The caller then appends only the remaining tokens (``plan_step`` with
        their ids, so they can be cached in turn). To get logits for the last
        prompt token, pass ``prompt[:-1]`` here.
        """
        if self.host_tier is None:
            return self.block_manager.add_sequence(seq_id, token_ids)
        hit, plan = self.block_manager.add_sequence_plan(seq_id, token_ids)
        if plan.to_device:
            self._handing_out_pages(f"sequence {seq_id!r} restored a prefix from the host")
        ev = self._run(plan)
        if ev is not None:
            self._arrivals[seq_id] = ev
        return hit

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` shares every page of ``parent``; the first write into a shared page copies it."""
        self.block_manager.fork(parent, child)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; its pages return to the pool (or the prefix cache).

        If the sequence is in the planned step, that step can no longer run
        (plan a new one): its pages may be handed out again.
        """
        self.block_manager.free(seq_id)
        if self._arrivals:
            self._await(seq_id)  # its device pages are handed out again: copies into them come first
        self._invalidate([seq_id], "freed")

    def seq_len(self, seq_id: Hashable) -> int:
        return self.block_manager.seq_len(seq_id)

    def sequences(self) -> list[Hashable]:
        return self.block_manager.sequences()

    # -- planning -------------------------------------------------------------
    def plan_step(self, seq_ids: Sequence[Hashable], num_new_tokens_per_seq: Sequence[int] | int,
                  token_ids: Sequence[Sequence[int] | None] | None = None) -> StepMetadata:
        """Reserve the step's slots and upload its metadata; call once per model step.

        ``num_new_tokens_per_seq``: tokens each sequence adds this step (an int
        means the same for all; 0 is allowed). ``token_ids``: per sequence,
        the ids of those tokens (or None) so full pages enter the prefix
        cache. Raises OutOfPages with nothing changed.
        """
        seq_ids = seq_id_list(seq_ids, "plan_step")
        try:
            if isinstance(num_new_tokens_per_seq, Sequence):
                num_new = tuple(operator.index(n) for n in num_new_tokens_per_seq)
            else:
                num_new = (operator.index(num_new_tokens_per_seq),) * len(seq_ids)
        except TypeError:
            raise KvgenRuntimeError(
                f"plan_step token counts must be ints, got {num_new_tokens_per_seq!r}") from None
        if not seq_ids:
            raise KvgenRuntimeError("plan_step needs at least one sequence id")
        bm = self.block_manager
        if self.host_tier is None:
            reservation = bm.reserve_step(seq_ids, num_new, token_ids)
        else:
            reservation = self._reserve_tiered(seq_ids, num_new, token_ids)
        self._steps += 1
        tier = self.host_tier
        step = build_step(self._steps, bm, self._buffers, seq_ids, num_new, reservation,
                          self.page_pool if tier is not None else None,
                          on_cold=self._stage_first if tier is not None else None)
        step.configs = self._configs(step)
        self.step = step
        return step

    # -- per-layer ops (no host synchronization) -----------------------------------
    def _current(self, seq_ids: Sequence[Hashable] | None) -> StepMetadata:
        step = self.step
        if step is None:
            raise KvgenRuntimeError("no step is planned; call plan_step(seq_ids, num_new_tokens) first")
        if step.stale is not None:
            raise KvgenRuntimeError(f"{step.stale}; call plan_step for the live sequences first")
        if seq_ids is not None and seq_ids is not step.seq_ids and (
                seq_id_list(seq_ids, "the layer op") != step.seq_ids):
            raise KvgenRuntimeError(
                f"the sequences {list(seq_ids)[:8]} are not the planned step's {list(step.seq_ids)[:8]}; "
                f"call plan_step for this batch first")
        return step

    def _layer(self, layer: int) -> dict[str, torch.Tensor]:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise KvgenRuntimeError(f"layer must be in 0..{self.num_layers - 1}, got {layer!r}")
        return self.pools[layer]

    def _as_input(self, name: str, x: torch.Tensor, rows: int, heads: int) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise KvgenRuntimeError(f"{name} must be a torch.Tensor [{rows}, {heads}, {self.head_dim}], "
                                    f"got a {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise KvgenRuntimeError(f"{name} must be a real floating-point tensor ({self.dtype} ideally), "
                                    f"got {x.dtype}")
        if x.device.type == "meta" and self.device.type != "meta":
            raise KvgenRuntimeError(f"{name} is a meta tensor (no data); pass a tensor on {self.device}")
        if x.dim() != 3 or x.shape[0] != rows or x.shape[1] != heads or x.shape[2] != self.head_dim:
            raise KvgenRuntimeError(
                f"{name} must be [{rows}, {heads}, {self.head_dim}] for this step, got {list(x.shape)}")
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if x.device != self.device:
            x = x.to(self.device)
        return x.contiguous()

    def _out(self, out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        if out is None:
            return torch.empty_like(q)
        if (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != self.dtype
                or out.device != self.device or not out.is_contiguous()):
            got = (f"{list(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                   else f"a {type(out).__name__}")
            raise KvgenRuntimeError(
                f"out must be a contiguous {list(q.shape)} {self.dtype} tensor on {self.device} "
                f"(like q), got {got}; or leave out=None")
        return out

    def pool_tensors(self, layer: int, pool: str) -> list[torch.Tensor]:
        """The tensors of one pool of one layer, in kernel order (for page_copy)."""
        self._layer(layer)
        return self.page_pool.tensors(layer, pool)

    def append_kv(self, layer: int, seq_ids: Sequence[Hashable] | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V of one layer: copies, then the write, then page conversions.

        ``k``, ``v``: ``[total_new_tokens, H_kv, D]``, sequences in step order,
        each sequence's tokens in order.
        """
        step = self._current(seq_ids)
        pools = self._layer(layer)
        k = self._as_input("k", k, step.total_tokens, self.num_kv_heads)
        v = self._as_input("v", v, step.total_tokens, self.num_kv_heads)
        self._write(step, layer, pools, k, v)

    def _write(self, step: StepMetadata, layer: int, pools: dict[str, torch.Tensor],
               k: torch.Tensor, v: torch.Tensor, convert: bool = True) -> None:
        # append_kv's body for inputs already checked by _as_input (prefill checks them once for both uses);
        # convert=False: the caller runs the conversions itself (decode, after its attention)
        if layer in step.written:
            raise KvgenRuntimeError(f"layer {layer} was already written this step; plan a new step first")
        single = len(step.phases) == 1
        for ph in step.phases:
            for pool, src, dst in ph.copies:
                self.kernels["page_copy"].launch(self.page_pool.tensors(layer, pool), src, dst)
            if ph.end > ph.start:
                if single:
                    self.kernels["cache_write"].launch(k, v, pools, ph.slot_mapping)
                else:
                    self.kernels["cache_write"].launch(k[ph.start:ph.end], v[ph.start:ph.end], pools,
                                                       ph.slot_mapping)
            if ph.conversions is not None and convert:
                self.kernels["page_quantize"].launch(pools, ph.conversions[0], ph.conversions[1])
        step.written.add(layer)

    @staticmethod
    def _conversions_after_attention(step: StepMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's conversions ``(src, dst)`` when its attention may run before them (its pre-conversion
        view: :mod:`.preconversion`): one phase that converts, no cold pages (their per-layer tables are the
        host tier's); else None."""
        if step.cold is not None or len(step.phases) != 1:
            return None
        return step.phases[0].conversions

    def _check_written(self, step: StepMetadata, layer: int) -> None:
        if step.total_tokens and layer not in step.written:
            raise KvgenRuntimeError(
                f"layer {layer}: this step's K/V are not written yet; call append_kv (or pass k, v) first")

    def decode(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable] | None = None,
               k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, sm_scale: float | None = None) -> torch.Tensor:
        """Attention of each sequence's newest token over its cache: ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

        The step must add exactly one token per sequence; pass ``k``, ``v``
        (``[B, H_kv, D]``) to write them first, or call :meth:`append_kv`.

        Given ``k`` and ``v`` in a step that converts pages (a residual scheme's page leaving the residual
        window), the attention runs before the conversions and reads those pages from their residual copies, in the
        compute dtype (:mod:`.preconversion`; the engine's CUDA graphs do the same, and overlap the
        conversions with the next kernels); after :meth:`append_kv` the pages are converted already and read
        compressed. Either way they are compressed when the call returns.
        """
        step = self._current(seq_ids)
        pools = self._layer(layer)
        if not step.is_decode:
            raise KvgenRuntimeError("decode needs a step adding one token per sequence; use prefill for this step")
        q = self._as_input("q", q, step.batch, self.num_q_heads)  # checked before anything is written
        out = self._out(out, q)
        after = None
        if k is not None and v is not None and (after := self._conversions_after_attention(step)) is not None:
            k = self._as_input("k", k, step.total_tokens, self.num_kv_heads)
            v = self._as_input("v", v, step.total_tokens, self.num_kv_heads)
            self._write(step, layer, pools, k, v, convert=False)
        elif k is not None or v is not None:
            self.append_kv(layer, None, k, v)
        self._check_written(step, layer)
        pools, tables = self._attention(step, layer)
        num_compressed = step.num_compressed
        if after is not None:
            if step.pre_view is None:  # once a step, for every layer
                step.pre_view = pre_conversion_view(tables, num_compressed, *after)
            tables, num_compressed = step.pre_view
        try:
            self.kernels["decode"].launch(q, out, pools, tables, step.seq_lens, num_compressed,
                                          self.sm_scale if sm_scale is None else sm_scale,
                                          config=step.configs.get("decode"))
        finally:  # the books count the pages converted once the layer is written, whatever the attention did
            if after is not None:
                self.kernels["page_quantize"].launch(pools, *after)
        return out

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                seq_ids: Sequence[Hashable] | None = None, *, out: torch.Tensor | None = None,
                sm_scale: float | None = None) -> torch.Tensor:
        """Causal attention of the step's new tokens: ``q [total_new_tokens, Hq, D]`` -> same shape.

        Sequence ``b``'s rows of ``q`` are its ``num_new[b]`` tokens of this
        step (the last ones of the sequence). With ``k``, ``v``
        (``[total_new_tokens, H_kv, D]``, the same rows) they are written into
        the pages (as :meth:`append_kv`) and the kernel attends these tokens
        from ``k``/``v`` exactly, in the compute dtype, and only the earlier
        tokens from the pages, so a prompt never sees itself quantized while
        later steps read the compressed copy. With ``k = v = None`` (the
        caller ran :meth:`append_kv` already) every key is read from the
        pages, the step's own ones included. Works for any step, decode steps
        included. A mixed step's sequences adding one token (:class:`~.step.DecodeRows`) are attended by the
        decode kernel, from the pages (their new token too), as in a decode step, when the prefill module
        can skip them (``SKIPS_ROWS``; not in packages generated before it).
        """
        step = self._current(seq_ids)
        pools = self._layer(layer)
        if (k is None) != (v is None):
            raise KvgenRuntimeError("pass both k and v (the step's new K/V) to prefill, or neither")
        q = self._as_input("q", q, step.total_tokens, self.num_q_heads)  # checked before anything is written
        out = self._out(out, q)
        if k is not None:
            k = self._as_input("k", k, step.total_tokens, self.num_kv_heads)
            v = self._as_input("v", v, step.total_tokens, self.num_kv_heads)
            self._write(step, layer, pools, k, v)
        self._check_written(step, layer)
        if "prefill" not in step.configs:  # a decode step run through prefill
            step.configs["prefill"] = self._config("prefill", (step.batch, max(1, step.max_q_len), step.max_seq_len))
        pools, tables = self._attention(step, layer)
        module = self.kernels["prefill"]
        # A kernel choice that depends on per-sequence lengths (host ints): made once per step and key source.
        key = "prefill/fresh" if k is not None else "prefill/pages"
        if key not in step.configs:
            refine = getattr(module, "step_config", None)
            config = step.configs.get("prefill")
            step.configs[key] = config if refine is None else refine(config, step.num_new, step.seq_lens_host,
                                                                     k is not None)
        config = step.configs[key]
        sm_scale = self.sm_scale if sm_scale is None else sm_scale
        ones = step.decode_rows if self._splits_decode_rows() else None
        if ones is not None:  # the one-token rows of a mixed step: the decode kernel, then the chunks
            q_ones = q.index_select(0, ones.q_rows)
            attended = self.kernels["decode"].launch(
                q_ones, torch.empty_like(q_ones), pools,
                ones.block_tables if step.cold is None else tables.index_select(0, ones.index), ones.seq_lens,
                ones.num_compressed, sm_scale, config=step.configs.get("decode"))
            out.index_copy_(0, ones.q_rows, attended)
        module.launch(q, out, pools, tables, step.seq_lens, step.num_compressed, step.cu_seqlens_q,
                      max(1, step.max_q_len), sm_scale, config=config, k_new=k, v_new=v,
                      **({"skip_rows": ones.rows} if ones is not None else {}))
        return out


def load(plan: Mapping[str, Any], kernels: Mapping[str, ModuleType], device: torch.device | str | None = None,
         max_tokens: int | None = None, num_layers: int | None = None, dtype: torch.dtype | str | None = None,
         tp_rank: int = 0, tp_size: int = 1, autotune: bool = True, warmup: bool | None = None,
         variants: Mapping[str, Mapping[str, ModuleType]] | None = None, **kwargs: Any) -> KVCache:
    """A :class:`KVCache` for ``plan`` (plan.json as a dict) with ``kernels`` (op -> generated module).

    ``variants``: op -> backend -> module, every kernel a package holds for
    an op (its ``KERNEL_VARIANTS``; the first of each op is ``kernels[op]``).
    Where an op has several (``kvgen compile --backend auto``), the cache runs
    one, chosen per op (:mod:`.backend_choice`): the remembered choice of an
    earlier timing (``kvgen tune``), or with ``KVGEN_AUTOTUNE=sync`` on a GPU
    the variant whose tuned configs time faster now; else the first (Triton).
    ``cache.kernel_backends`` says which runs, ``cache.backend_choices`` why.

    ``device``: default the current CUDA device, else the CPU. ``max_tokens``:
    allocate about that many tokens of pages instead of the planner's whole
    budget (the compressed : residual proportion kept, the residual pool
    holding at least a few sequences' tails; ``max_seqs=`` sets how many).
    ``num_layers``: allocate only the first layers (tests). ``dtype``: must
    match the plan's compute dtype (a check). ``tp_rank``/``tp_size``: this
    process's tensor-parallel shard (``tp_size`` must equal the plan's tp).
    ``autotune``: tune kernel configs on first use of each shape bucket (GPU
    only; results persist under the cache directory).
    ``warmup``: compile the kernel variants steps will pick now, so no request
    waits for Triton (see :mod:`.warmup`; CUDA only, a few seconds, less with
    Triton's on-disk cache warm); default ``KVGEN_WARMUP`` (on). What it did
    is ``cache.warmup_report``; a warm-up that fails is a warning, never an error.
    """
    cache = KVCache(plan, kernels, device=device, max_tokens=max_tokens, num_layers=num_layers, dtype=dtype,
                    tp_rank=tp_rank, tp_size=tp_size, autotune=autotune, variants=variants, **kwargs)
    from .env import warmup_enabled
    from .warmup import WarmupReport, warm_up

    if not (warmup_enabled() if warmup is None else warmup):
        cache.warmup_report = WarmupReport(skipped="turned off (warmup=False or KVGEN_WARMUP=0)")
        return cache
    try:
        cache.warmup_report = warm_up(cache)
    except Exception as err:  # the kernels still compile on first use: slower, never wrong
        import warnings
        warnings.warn(f"kvgen: kernel warm-up failed ({type(err).__name__}: {err}); kernels compile on first "
                      f"use instead", RuntimeWarning, stacklevel=2)
        cache.warmup_report = WarmupReport(skipped=f"failed: {type(err).__name__}: {err}")
    return cache
