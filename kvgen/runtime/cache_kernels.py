"""KVCache's kernels: which ops a plan needs, whether they can run here, and each step's launch configs.

:func:`_check_kernels_can_run` refuses, at construction, a CPU cache whose
Triton kernels would not run (they run on the CPU only interpreted).
:class:`KernelConfigMixin` (a mixin of :class:`~.cache.KVCache`) picks the
launch config of each planned step's attention kernel through the cache's
:class:`~.autotune.Autotuner`, and builds the synthetic inputs a tuning run
times candidates on (``_bench``; also used by ``autotune.tune`` and warm-up).
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


class KernelConfigMixin:
    """Launch-config methods of KVCache (it provides autotuner, kernels, _hashes, pools, sizes, device...)."""

    def _configs(self, step: StepMetadata) -> dict[str, Any]:
        # Host-only lookups (a remembered winner or the model's config; timing only with
        # KVGEN_AUTOTUNE=sync); a decode step gets the decode config, any other step the
        # prefill one. Autotuner.config never raises, so plan_step stays all-or-nothing.
        configs: dict[str, Any] = {}
        if step.is_decode:
            configs["decode"] = self._config("decode", (step.batch, step.max_seq_len))
        else:
            configs["prefill"] = self._config("prefill", (step.batch, max(1, step.max_q_len), step.max_seq_len))
        return configs

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

    def _bench(self, op: str, shape: tuple[int, ...], config: dict[str, Any]):
        """A closure running ``op`` once with ``config`` on synthetic inputs of the bucket's shape (reads only).

        The inputs are made on the device once per (op, bucket) and shared by
        every candidate of that bucket; whoever tunes drops them afterwards
        (``_config``, ``autotune.tune``: ``self._bench_inputs``).
        """
        from .autotune import bucket
        B, S = bucket(shape[0]), bucket(shape[-1])
        Q = min(bucket(shape[1]), S) if op != "decode" else 1

        def inputs() -> dict[str, torch.Tensor]:
            # Random page ids (pages scattered as in a long-running server), drawn on the device.
            dev, P = self.device, self.page_size
            pages = -(-S // P)
            nc = pages if self.residual_tokens is None else max(0, S // P - self.residual_tokens // P)
            bt = torch.randint(0, max(1, self.num_pages), (B, pages), dtype=torch.int32, device=dev)
            if self.residual_tokens is not None and pages > nc:
                res = torch.randint(0, max(1, self.num_residual_pages), (B, pages), dtype=torch.int32, device=dev)
                bt = torch.where(torch.arange(pages, device=dev)[None, :] >= nc, res, bt)
            t = {"bt": bt, "seq_lens": torch.full((B,), S, dtype=torch.int32, device=dev),
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
        if memo is None or memo[0] != (op, B, Q, S):
            memo = ((op, B, Q, S), inputs())
            self._bench_inputs = memo
        t = memo[1]
        pools = self.pools[0]
        mod = self.kernels[op]
        if op == "decode":
            return lambda: mod.launch(t["q"], t["out"], pools, t["bt"], t["seq_lens"], t["ncomp"], self.sm_scale,
                                      config=config)
        # The chunk's own K/V fresh, as prefill(layer, q, k, v) -- the usual call -- runs the kernel.
        return lambda: mod.launch(t["q"], t["out"], pools, t["bt"], t["seq_lens"], t["ncomp"], t["cu"], Q,
                                  self.sm_scale, config=config, k_new=t["k_new"], v_new=t["v_new"])
