"""ModelRunner: one scheduled step through the model, attention on the kvgen runtime."""

from __future__ import annotations

from array import array
from typing import Any

import torch

from .model import CausalLM


class ModelRunner:
    """Runs steps of ``model`` over ``cache`` (a kvgen KVCache); decode steps through CUDA graphs when given.

    Steps adding several tokens to some sequence use the runtime's prefill
    op (it writes the chunk's K/V and attends them exactly, earlier tokens
    from the pages); pure decode steps use append + the decode kernel.
    """

    def __init__(self, model: CausalLM, cache: Any, graphs: Any = None) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = cache.device
        self.graph_steps = 0
        self.eager_steps = 0
        self._eager_next = False

    def eager_once(self) -> None:
        """Run the next step eagerly (the engine calls it when pages moved between the tiers just before)."""
        self._eager_next = True

    def _attend(self, step: Any):
        cache = self.cache
        if step.is_decode:
            return lambda layer, q, k, v: cache.decode(layer, q, None, k, v)
        return lambda layer, q, k, v: cache.prefill(layer, q, k, v)

    def _upload(self, input_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions on the device: one host tensor (pinned on CUDA), one copy."""
        n = len(input_ids)
        host = torch.frombuffer(array("q", input_ids + positions), dtype=torch.long) if n else \
            torch.empty(0, dtype=torch.long)
        if self.device.type == "cuda":
            # pinned: the copy is asynchronous (from pageable memory CUDA stages it synchronously)
            both = host.pin_memory().to(self.device, non_blocking=True)
        else:
            both = host.to(self.device)
        return both[:n], both[n:]

    def run(self, step: Any, input_ids: list[int], positions: list[int], sample_rows: list[int]) -> torch.Tensor | None:
        """float32 logits ``[len(sample_rows), vocab]`` of the step's rows ``sample_rows`` (None if none)."""
        ids, pos = self._upload(input_ids, positions)
        eager, self._eager_next = self._eager_next, False
        if self.graphs is not None and not eager and self.graphs.can_run(step):
            hidden = self.graphs.run(step, ids, pos)
            self.graph_steps += 1
        else:
            hidden = self.model(ids, pos, self._attend(step))
            self.eager_steps += 1
        if not sample_rows:
            return None
        if len(sample_rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.long).to(self.device))
        return self.model.logits(hidden)
