"""ModelRunner: one scheduled step through the model, attention on the kvgen runtime."""

from __future__ import annotations

from array import array
from typing import Any

import torch

from kvgen.runtime.step import DeviceBuffers

from .model import CausalLM
from .upload import to_device


class ModelRunner:
    """Runs steps of ``model`` over ``cache`` (a kvgen KVCache); decode steps through CUDA graphs when given.

    Steps adding several tokens to some sequence use the runtime's prefill
    op (it writes the chunk's K/V and attends them exactly, earlier tokens
    from the pages); pure decode steps use append + the decode kernel.
    """

    device_input_ids = True
    """:meth:`run` takes the token ids as a device tensor too (the engine's async scheduling feeds the
    previous step's sampled ids without a host round trip); a runner class without it gets lists only."""

    def __init__(self, model: CausalLM, cache: Any, graphs: Any = None) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = cache.device
        self.graph_steps = 0
        self.eager_steps = 0
        self._eager_next = False
        # the runtime's host-to-device helper, an instance of our own: the cache's would overwrite the
        # step metadata it just uploaded (the int64 slot mapping) with these ids and positions
        self._buffers = DeviceBuffers(self.device)

    def eager_once(self) -> None:
        """Run the next step eagerly (the engine calls it when pages moved between the tiers just before)."""
        self._eager_next = True

    def _attend(self, step: Any):
        cache = self.cache
        if step.is_decode:
            return lambda layer, q, k, v: cache.decode(layer, q, None, k, v)
        return lambda layer, q, k, v: cache.prefill(layer, q, k, v)

    def _upload(self, input_ids: list[int] | torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions on the device: one host tensor, one copy (:meth:`DeviceBuffers.upload`:
        pinned staging, asynchronous, into a persistent device buffer).

        Ids already on the device (a tensor) stay there; only the positions go up. The returned views are
        valid for this step: the next upload rewrites the buffer, after this step's kernels in stream order
        (CUDA graphs never read them: :class:`~.graphs.DecodeGraphs` copies them into its own buffers).
        """
        on_device = isinstance(input_ids, torch.Tensor)
        n = 0 if on_device else len(input_ids)
        values = positions if on_device else input_ids + positions
        host = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
        both = self._buffers.upload(host)
        return (input_ids if on_device else both[:n]), both[n:]

    def run(self, step: Any, input_ids: list[int] | torch.Tensor, positions: list[int],
            sample_rows: list[int]) -> torch.Tensor | None:
        """Logits ``[len(sample_rows), vocab]`` of the step's rows ``sample_rows`` (None if none), in the model's
        dtype (the sampler widens them where it needs float32: :mod:`.sampler`).

        ``input_ids``: a list, or an int64 tensor on the cache's device (read
        in stream order: it may still be being computed). Launches the step
        and returns without waiting for the device.
        """
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
            hidden = hidden.index_select(0, to_device(sample_rows, torch.long, self.device))
        return self.model.logits(hidden, float32=False)
