"""Decode steps as CUDA graphs: the whole model (every layer) captured once per batch-size bucket.

The runtime's StepMetadata views move between steps (they are slices of a
grow-only buffer whose offsets depend on the batch and the table width),
so the graphs read engine-owned static buffers instead -- token ids,
positions, block tables ``[max_batch, max_pages]``, sequence lengths,
compressed-page counts and the slot mapping -- which :meth:`run` fills from
the step's metadata (device-to-device copies) before a replay. Rows beyond
the batch are padding: slot -1 (the cache write skips it) and length 0;
their outputs are dropped.

Schemes with residual pages (int4 keeps the partly filled tail page in the
compute dtype) convert a page each time one fills, i.e. in most decode
steps of a large batch; for them each bucket gets a second graph that runs
page_quantize after each layer's attention, over ``b`` static (src, dst)
pairs: the step's conversions, padded with src -1, which the kernel skips (a
step converting one page pays for one, not ``b``). Its attention reads the
converted pages from their residual copies (the tables before the
conversions, computed in the graph: :mod:`kvgen.runtime.preconversion`, as
``KVCache.decode`` does), so the conversions run on a side stream beside the
next kernels, joined at the step's end: launched between the write and the
attention, their latency (~6 us a layer on an H200 whatever the page count)
cost a Llama-3-8B step at batch 32 some 0.12-0.21 ms. A step replays when it is a
pure decode step in a single phase without copy-on-write copies (the first
step after a fork has them) and without cold pages (a host tier's pages
staged inside the layer loop); anything else runs eagerly through the
runtime (the same model code). The decode config is fixed at capture: the
runtime's choice for the bucket's batch at the longest context
(``KVCache.kernel_config``). Before the first capture the buckets of up to
:data:`.gemv.MAX_CHOICE_ROWS` rows time cuBLAS against kvgen's GEMV (up to
4 rows) or small GEMM for each projection shape (:func:`.gemv.choose`;
a later start on the same GPU reuses those decisions: :mod:`.projection_store`);
the graphs keep what won. On Hopper every kvgen kernel of a graph (the
fused elementwise kernels, the GEMV and small GEMM, the runtime's cache
write, page quantize and decode) launches with
programmatic dependent launch (:mod:`.pdl`; ``KVGEN_PDL=0`` turns it off).
Where the scheme stores new tokens unquantized (bf16 pages; int4's
residual pages), the kernel that applies RoPE -- the q/k/v small GEMM's
epilogue, or the RoPE kernel after the projection -- also stores k and v
into their slots (:data:`WRITE_THROUGH`, :mod:`.kv_write`): no cache
write kernel a layer.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvgen.runtime.preconversion import pre_conversion_view

from . import gemv, pdl
from .kv_write import KVWrite
from .model import CausalLM

WRITE_THROUGH = True
"""Whether the graphs let the kernel that applies RoPE to q/k/v (the small GEMM's epilogue or the RoPE kernel)
store k and v into the cache pages itself (``write`` of :func:`.gemv.qkv_rope_linear` and :func:`.fused.qkv_rope`)
where the scheme keeps new tokens as they are (its cache_write module's ``PLAIN_TARGET``), so no cache write
kernel runs; False (comparisons): the write kernel every layer."""

SMALL_BUCKETS = (1, 2, 4, 8)


def buckets_for(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, the last one >= ``max_batch``."""
    cands = [*SMALL_BUCKETS, *range(16, max_batch + 16, 16)]
    return [c for c in cands if c < max_batch] + [next(c for c in cands if c >= max_batch)]


class DecodeGraphs:
    """Captured decode graphs over ``model`` and ``cache`` (a KVCache on a CUDA device)."""

    def __init__(self, model: CausalLM, cache: Any, max_batch: int, max_model_len: int, *, verbose: bool = True,
                 capture: bool = True, conversions_after_attention: bool = True) -> None:
        """``capture=False`` runs the same static-buffer steps eagerly (any device): tests of the graph path.
        ``conversions_after_attention=False``: a converting step's conversions run between each layer's write
        and its attention, which reads them compressed (the order before 2026-12-04, for comparisons)."""
        self.model, self.cache = model, cache
        dev = cache.device
        self.buckets = buckets_for(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_pages = -(-max_model_len // cache.page_size) + 1
        n = self.max_batch
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.num_compressed = torch.zeros(n, dtype=torch.int32, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.conv_src = torch.zeros(n, dtype=torch.int32, device=dev)
        self.conv_dst = torch.zeros(n, dtype=torch.int32, device=dev)
        # a converting step's tables before its conversions (the attention reads them: .preconversion)
        self.pre_tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self.pre_compressed = torch.zeros(n, dtype=torch.int32, device=dev)
        self.residual = getattr(cache, "residual_tokens", None) is not None
        # the decode kernel's split arrival counters, owned here: every graph keeps their address
        make_counters = getattr(cache.kernels["decode"], "split_counters", None)
        self.counters = make_counters(n, dev) if make_counters is not None else None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.capture = capture
        self.converted_steps = 0
        kinds = (False, True) if self.residual else (False,)
        variants = [(b, conv) for b in reversed(self.buckets) for conv in kinds] if capture else []
        pool = None
        # Warm-up and capture on one stream of ours: per-stream state made on first use (cuBLAS workspaces;
        # the per-stream split counters of a package whose decode module has no split_counters) then
        # exists before the capture, not inside it.
        stream = torch.cuda.Stream(dev) if capture else None
        # where a captured graph's page conversions run, beside the kernels after each layer's attention
        self.after = conversions_after_attention
        self.side = torch.cuda.Stream(dev) if capture and self.after else None
        # the projections' kernel per small bucket, decided before any capture keeps it (what won, and the times)
        self.gemv_choices = gemv.choose(model, [b for b in self.buckets if b <= gemv.MAX_CHOICE_ROWS],
                                        verbose=verbose, saved=gemv.store(dev)) if capture else []
        for i, key in enumerate(variants):
            b = key[0]
            if verbose:
                print(f"\rkvgen: capturing decode graphs {i + 1}/{len(variants)} (batch {b})",
                      end="", file=sys.stderr, flush=True)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self._forward(*key)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self.outputs[key] = self._forward(*key)
            pool = g.pool()
            self.graphs[key] = g
        if capture:
            torch.cuda.synchronize(dev)
        if verbose and capture:
            print(file=sys.stderr)

    def _forward(self, b: int, convert: bool) -> torch.Tensor:
        """The step of bucket ``b`` on the static buffers (what a graph captures): a converting one computes
        its pre-conversion tables first, and its conversions, launched on the side stream after each layer's
        attention when capturing, are joined before it ends."""
        if convert and self.after:
            pre_conversion_view(self.block_tables[:b], self.num_compressed[:b], self.conv_src[:b],
                                self.conv_dst[:b], self.pre_tables[:b], self.pre_compressed[:b])
        hidden = self.model(self.ids[:b], self.pos[:b], self._attend(b, convert))
        if convert and self.side is not None:
            torch.cuda.current_stream(hidden.device).wait_stream(self.side)
        return hidden

    def _attend(self, b: int, convert: bool):
        cache = self.cache
        write, decode = cache.kernels["cache_write"], cache.kernels["decode"]
        quantize = cache.kernels.get("page_quantize") if convert else None
        side = self.side
        # the runtime's config for this batch at the longest context (a graph serves every length up to it;
        # the kernel divides each sequence's pages among its splits); a package whose runtime predates
        # kernel_config gets the kernel's shape default
        pick = getattr(cache, "kernel_config", None)
        config = pick("decode", (b, self.max_pages * cache.page_size)) if pick is not None else None
        slots, lens = self.slots[:b], self.seq_lens[:b]
        # a converting step attends before its conversions (KVCache.decode's order; .preconversion)
        after = convert and self.after
        tables = self.pre_tables[:b] if after else self.block_tables[:b]
        ncomp = self.pre_compressed[:b] if after else self.num_compressed[:b]
        src, dst = self.conv_src[:b], self.conv_dst[:b]
        counters = {} if self.counters is None else {"counters": self.counters}
        # getattr: a package whose write module predates PLAIN_TARGET keeps the write kernel
        plain = getattr(write, "PLAIN_TARGET", None) if WRITE_THROUGH else None

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
            pools = cache.pools[layer]
            on = pdl.enabled(q)  # the runtime's kernels overlap their launches with the step's others too
            if k is not None:  # (None: the q/k/v projection stored them: kv_write)
                write.launch(k.contiguous(), v.contiguous(), pools, slots, pdl=on)
            if quantize is not None and not after:
                quantize.launch(pools, src, dst, pdl=on)
            out = torch.empty_like(q)
            decode.launch(q.contiguous(), out, pools, tables, lens, ncomp, cache.sm_scale, config=config,
                          pdl=on, **counters)
            if quantize is not None and after:
                if side is None:
                    quantize.launch(pools, src, dst)
                else:
                    # off the layer chain: nothing of this step reads the compressed pages, and the residual
                    # ones stay until the step ends (joined in _forward)
                    side.wait_stream(torch.cuda.current_stream(q.device))
                    with torch.cuda.stream(side):
                        quantize.launch(pools, src, dst)
            return out

        if plain is not None:
            def kv_write(layer: int) -> KVWrite:
                pools = cache.pools[layer]
                return KVWrite(pools[plain[0]], pools[plain[1]], slots, write.PAGE, write.PLAIN_ROW_STRIDE)

            attend.kv_write = kv_write
        return attend

    def can_run(self, step: Any) -> bool:
        # getattr: a package compiled before the host tier existed ships a runtime without ``cold``
        return (step.is_decode and getattr(step, "cold", None) is None and step.batch <= self.max_batch
                and step.num_copies == 0 and (step.num_conversions == 0 or self.residual)
                and step.num_conversions <= step.batch and len(step.phases) == 1
                and step.max_pages <= self.max_pages)

    def run(self, step: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode step (check :meth:`can_run` first)."""
        B = step.batch
        b = next(x for x in self.buckets if x >= B)
        self.ids[:B].copy_(input_ids)
        self.pos[:B].copy_(positions)
        self.block_tables[:B, :step.max_pages].copy_(step.block_tables)
        self.seq_lens[:B].copy_(step.seq_lens)
        self.num_compressed[:B].copy_(step.num_compressed)
        self.slots[:B].copy_(step.slot_mapping)
        if b > B:
            self.seq_lens[B:b].zero_()
            self.slots[B:b].fill_(-1)
        M = step.num_conversions
        if M:
            self.converted_steps += 1
            src, dst = step.phases[0].conversions
            self.conv_src[:M].copy_(src)
            self.conv_dst[:M].copy_(dst)
            if b > M:
                self.conv_src[M:b].fill_(-1)
        key = (b, M > 0)
        if not self.capture:
            return self._forward(*key)[:B]
        self.graphs[key].replay()
        return self.outputs[key][:B]
