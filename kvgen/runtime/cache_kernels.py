"""KVCache's kernels: which ops a plan needs, whether they can run here, which variant runs, launch configs.

:func:`_check_kernels_can_run` refuses, at construction, a CPU cache whose
Triton kernels would not run (they run on the CPU only interpreted).
:class:`KernelConfigMixin` (a mixin of :class:`~.cache.KVCache`) holds every
variant of each op (``kernel_variants``: a ``--backend auto`` package's
Triton and CUDA modules) and which one runs (:mod:`.backend_choice`), picks
the launch config of each planned step's attention kernel through the
cache's :class:`~.autotune.Autotuner`, and builds the synthetic inputs a
tuning run times candidates on (``_bench``; also used by ``autotune.tune``,
the backend choice and warm-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from .env import triton_interpret
from .errors import KvgenRuntimeError
from .step import StepMetadata

REQUIRED_OPS = ("decode", "prefill", "cache_write", "page_copy")


def _check_kernels_can_run(device: torch.device, kernels: Mapping[str, ModuleType]) -> None:
    """Refuse a CPU cache whose Triton kernels would not run in the interpreter (Triton: '0 active drivers')."""
    if device.type != "cpu":
        return
    # Generated modules record at import whether Triton interprets them (INTERPRET); triton.jit decides then too.
    compiled = sorted(op for op, mod in kernels.items() if getattr(mod, "INTERPRET", None) is False)
    if compiled or not triton_interpret():
        when = (f"the kernels ({', '.join(compiled)}) were imported without it" if compiled and triton_interpret()
                else "TRITON_INTERPRET is not set")
        raise KvgenRuntimeError(
            f"Triton kernels cannot run on the CPU unless interpreted, and {when}: set TRITON_INTERPRET=1 "
            f"in the environment before triton (or the generated package) is imported, or use a CUDA device")


def _backend_of(module: ModuleType) -> str:
    return str(getattr(module, "BACKEND", "triton"))  # generated Triton modules carry no BACKEND


def _variants(kernels: Mapping[str, ModuleType], variants: Mapping[str, Mapping[str, ModuleType]] | None
              ) -> dict[str, dict[str, ModuleType]]:
    """Op -> backend -> module for every op of ``kernels``; ``variants[op]``'s first module must be ``kernels[op]``."""
    out = {op: {_backend_of(module): module} for op, module in kernels.items()}
    for op, by_backend in (variants or {}).items():
        if not isinstance(by_backend, Mapping) or not by_backend or op not in kernels:
            raise KvgenRuntimeError(f"variants[{op!r}] must be a non-empty mapping backend -> module of an op the "
                                    f"kernels have; pass the package's KERNEL_VARIANTS (or leave variants out)")
        if next(iter(by_backend.values())) is not kernels[op]:
            raise KvgenRuntimeError(f"the first of variants[{op!r}] must be kernels[{op!r}] (the op's default); "
                                    f"pass the package's KERNELS and KERNEL_VARIANTS together")
        out[op] = {str(b): m for b, m in by_backend.items()}
    return out


class KernelConfigMixin:
    """Kernel-variant and launch-config methods of KVCache (it provides autotuner, kernels, kernel_variants,
    _hashes, plan, pools, sizes, device...).

    ``kernel_backends``: op -> the backend of the module ``kernels[op]`` runs;
    ``backend_choices``: op -> :class:`~.backend_choice.BackendChoice` (why
    that one) for each op with more than one variant.
    """

    def _variant_hash(self, op: str, backend: str) -> str | None:
        """plan.json's KernelSpec hash of ``op``'s ``backend`` kernel (None: the module's header says)."""
        entry = (self.plan.get("kernels") or {}).get(op) or {}
        if backend in (entry.get("variants") or {}):
            return entry["variants"][backend].get("hash")
        return entry.get("hash") if entry.get("backend", "triton") == backend else None

    def _choose_backends(self) -> None:
        """At construction: which variant of each op runs (kernels[op] is the first until chosen)."""
        self._hashes = {op: self._variant_hash(op, _backend_of(m)) for op, m in self.kernels.items()}
        self.kernel_backends = {op: next(iter(v)) for op, v in self.kernel_variants.items()}
        self.backend_choices = {}
        for op, by_backend in self.kernel_variants.items():
            if len(by_backend) > 1:
                self._choose_backend(op, self._plan_shapes(op))

    def _plan_shapes(self, op: str) -> list[tuple[int, ...]]:
        # What the plan was made for: its context, alone and at its concurrency.
        context = int(self.plan.get("context") or 4096)
        if op == "decode":
            return [(1, context), (max(1, int(self.plan.get("concurrency") or 1)), context)]
        return [(1, context, context)]

    def choose_backend(self, op: str, shapes=(), *, retime: bool = False, plan_shapes: bool = True):
        """Decide now which variant of ``op`` runs from here on, and return the
        :class:`~.backend_choice.BackendChoice`.

        A choice already made (timed or remembered, at load or by an earlier
        call) is kept unless ``retime``. Otherwise the variants are timed at
        the plan's shapes (unless not ``plan_shapes``) and ``shapes`` (with
        ``retime`` also at the op's tuned buckets), whatever
        ``KVGEN_AUTOTUNE``'s mode (except ``off``), and the choice is
        persisted. Where nothing can be timed (no CUDA device, the
        interpreter, ``autotune=False``) what runs stays. An op with one
        variant keeps it; an op the cache has no kernel for is a
        KvgenRuntimeError. Call before capturing CUDA graphs over
        ``kernels[op]``; a variant that cannot run is skipped with a warning,
        never raised.
        """
        if op not in self.kernels:
            raise KvgenRuntimeError(f"no {op!r} kernel to choose; this cache's ops: {', '.join(sorted(self.kernels))}")
        if len(self.kernel_variants.get(op, {})) < 2:
            from .backend_choice import BackendChoice
            backend = self.kernel_backends.get(op, "triton")
            return self.backend_choices.get(op) or BackendChoice(op, backend, "first", f"{backend}: the only {op} kernel")
        before = self.backend_choices.get(op)
        if not retime and before is not None and before.origin in ("timed", "remembered"):
            return before  # decided already (at load, its kernel probed then): nothing to time or launch again
        given = [*(self._plan_shapes(op) if plan_shapes else ()), *shapes]
        choice = self._choose_backend(op, given, explicit=retime, decide=True)
        if choice.origin == "first" and before is not None and before.origin != "first":
            self._use_choice(op, before)  # nothing was timed now: what ran (a remembered choice) stands
            return before
        return choice

    def _choose_backend(self, op: str, shapes=(), *, explicit: bool = False, decide: bool = False):
        """Choose ``op``'s variant (:func:`.backend_choice.choose`) and run it from now on; returns the choice."""
        from .backend_choice import choose

        by_backend = self.kernel_variants[op]
        choice = choose(self.autotuner, op, {b: (m, self._variant_hash(op, b)) for b, m in by_backend.items()},
                        lambda module, shape: (lambda cfg: self._bench(op, shape, cfg, module)), shapes,
                        explicit=explicit, decide=decide, release=lambda: self.__dict__.pop("_bench_inputs", None))
        self._use_choice(op, choice)
        return choice

    def _use_choice(self, op: str, choice) -> None:
        self.kernels[op] = self.kernel_variants[op][choice.backend]
        self._hashes[op] = self._variant_hash(op, choice.backend)
        self.kernel_backends[op] = choice.backend
        self.backend_choices[op] = choice

    def _configs(self, step: StepMetadata) -> dict[str, Any]:
        # Host-only lookups (a remembered winner or the model's config; timing only with
        # KVGEN_AUTOTUNE=sync); a decode step gets the decode config, any other step the
        # prefill one, and a mixed step's one-token rows a decode config for their own shape.
        # Autotuner.config never raises, so plan_step stays all-or-nothing.
        configs: dict[str, Any] = {}
        if step.is_decode:
            configs["decode"] = self._config("decode", (step.batch, step.max_seq_len))
        else:
            configs["prefill"] = self._config("prefill", (step.batch, max(1, step.max_q_len), step.max_seq_len))
            rows = step.decode_rows  # a mixed step's one-token rows: the decode kernel's shape
            if rows is not None and self._splits_decode_rows():
                configs["decode"] = self._config("decode", (len(rows.rows), rows.max_seq_len))
        return configs

    def _splits_decode_rows(self) -> bool:
        """Whether a mixed step's one-token rows go through the decode kernel (:class:`~.step.DecodeRows`):
        when the prefill module can skip them (packages generated before ``skip_rows`` cannot)."""
        return bool(getattr(self.kernels["prefill"], "SKIPS_ROWS", False))

    def kernel_config(self, op: str, shape: tuple[int, ...]) -> dict[str, Any] | None:
        """The launch config ``op`` gets at ``shape``, as a step of that shape would: decode ``(batch,
        max_seq_len)``, prefill ``(batch, max_q_len, max_seq_len)``. The autotuner's remembered winner of
        the shape's bucket or its model's choice (it times candidates only in its ``sync`` mode); None
        means the kernel's own default. For callers that fix a config ahead of the steps (CUDA graphs)."""
        return self._config(op, shape)

    def _config(self, op: str, shape: tuple[int, ...]) -> dict[str, Any] | None:
        try:
            return self.autotuner.config(op, self.kernels[op], shape, lambda cfg: self._bench(op, shape, cfg),
                                         self._hashes.get(op))
        finally:
            self.__dict__.pop("_bench_inputs", None)  # tuning's synthetic inputs (GBs for a long prefill)

    def _bench(self, op: str, shape: tuple[int, ...], config: dict[str, Any] | None, module: ModuleType | None = None,
               *, exact: bool = False):
        """A closure running ``op`` (``module``: this variant of it) once with ``config`` on synthetic inputs of
        the bucket's shape (reads only).

        The inputs are made on the device once per (op, bucket) and shared by
        every candidate and variant of that bucket; whoever tunes drops them
        afterwards (``_config``, ``autotune.tune``: ``self._bench_inputs``).
        Successive calls cycle through the block tables of
        :func:`.kernel_timer.cold_page_tables` (``call.cycle`` calls make a
        whole turn), so a bucket smaller than L2 is timed cold, as a model's
        layer runs it.

        Decode calls alternate between sequences of the bucket's length and
        of half of it: a decode bucket serves every length in ``(S/2, S]``
        (a CUDA graph's config every length up to its longest), so a timing
        is the mean over the two ends and the winner the config best over
        the range (``exact``: the bucket's length alone, for experiments that
        compare lengths). The two lengths alternate over the tables (an even
        number of them, :func:`.kernel_timer.cold_page_tables`), and
        ``call.period = 2`` keeps both in a timing of calls of a millisecond
        or more. A scheme that keeps more than its tail page in the compute
        dtype (int2's 128 tokens) is timed at the length alone: a sequence of
        half the length splits its pages between the pools otherwise, which
        these inputs do not hold. Timed at its end alone, int4 at 32 x 4096
        (Llama-3-8B's heads, H200) ranked 4 warps and 2 splits within 2.4% of
        8 warps and 1 split and chose them; at 2048 tokens, where the engine's
        benchmark runs that graph, they cost 6% more (39.6 against 37.3 us,
        benchmarks/results/2026-12-04-nvidia-h200-5).
        """
        from .autotune import bucket
        from .kernel_timer import cold_page_tables, cycling
        B, S = bucket(shape[0]), bucket(shape[-1])
        Q = min(bucket(shape[1]), S) if op != "decode" else 1
        dev, P = self.device, self.page_size
        pages = -(-S // P)
        nc = pages if self.residual_tokens is None else max(0, S // P - self.residual_tokens // P)
        span = op == "decode" and not exact and not self.residual_tokens  # both ends of the bucket's range

        def inputs() -> dict[str, Any]:
            # Block tables of random pages, one per input set the timer cycles through (each call finds its pages
            # cold, as a model's layer does; a prefill reads only its cached prefix from pages); the rest is
            # small and shared.
            read = pages if op == "decode" else -(-(S - Q) // P)
            window = int(self.plan.get("sliding_window") or 0)
            if window:  # the kernels never load pages wholly before the window
                read = min(read, -(-window // P) + 1)
            pools, tables = cold_page_tables(self.pools[0], B, pages, nc, read, alternating=span)
            t: dict[str, Any] = {"pools": pools, "bts": tables,
                                 "seq_lens": torch.full((B,), S, dtype=torch.int32, device=dev),
                                 "half_lens": torch.full((B,), max(1, S // 2), dtype=torch.int32, device=dev),
                                 "ncomp": torch.full((B,), nc, dtype=torch.int32, device=dev)}
            rows = B if op == "decode" else B * Q
            t["q"] = torch.randn(rows, self.num_q_heads, self.head_dim, device=dev, dtype=self.dtype)
            t["out"] = torch.empty_like(t["q"])
            if op != "decode":
                t["k_new"] = torch.randn(rows, self.num_kv_heads, self.head_dim, device=dev, dtype=self.dtype)
                t["v_new"] = torch.randn_like(t["k_new"])
                t["cu"] = torch.arange(0, B + 1, dtype=torch.int32, device=dev) * Q
            return t

        memo = getattr(self, "_bench_inputs", None)
        if memo is None or memo[0] != (op, B, Q, S, span):
            memo = ((op, B, Q, S, span), inputs())
            self._bench_inputs = memo
        t = memo[1]
        pools = t["pools"]
        mod = module if module is not None else self.kernels[op]
        if op == "decode":
            # (table, lengths) in turn: every table in order, the lengths alternating (one table: both on it)
            tables, full, half = t["bts"], t["seq_lens"], t["half_lens"]
            turns = [(bt, full) for bt in tables]
            if span:
                turns = [(tables[0], full), (tables[0], half)] if len(tables) == 1 else \
                        [(bt, full if i % 2 == 0 else half) for i, bt in enumerate(tables)]
            call = cycling(turns, lambda turn: mod.launch(t["q"], t["out"], pools, turn[0], turn[1], t["ncomp"],
                                                          self.sm_scale, config=config))
            call.period = 2 if span else 1
            return call
        # The chunk's own K/V fresh, as prefill(layer, q, k, v) -- the usual call -- runs the kernel.
        return cycling(t["bts"], lambda bt: mod.launch(t["q"], t["out"], pools, bt, t["seq_lens"], t["ncomp"], t["cu"],
                                                       Q, self.sm_scale, config=config, k_new=t["k_new"],
                                                       v_new=t["v_new"]))
