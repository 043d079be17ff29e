"""The host tier's decode-step cost model: the one formula the planner and the host-tier benchmark share.

A decode step reads every live sequence's KV once. Pages resident on the
device are read from device memory; cold pages (on the host) first cross the
host link into a two-slot staging ring on a side stream, one layer ahead of
the attention that reads them (kvgen.runtime.host_tier), and are then read
from device memory like the rest. The copy of layer ``l + 1`` overlaps the
attention of layer ``l``, so over ``L`` layers a step is a two-stage
pipeline with per-layer stages ``G / L`` (device reads) and ``T / L``
(transfer)::

    step = T/L + (L - 1) * max(G, T)/L + G/L = max(G, T) + min(G, T) / L

-- about ``max(G, T)``, not ``G + T``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostStepCost:
    """Milliseconds of one decode step: ``gpu_ms`` (all KV read from device memory), ``transfer_ms``
    (the host-resident KV over the host link) and ``step_ms`` (the two overlapped, see the module)."""

    gpu_ms: float
    transfer_ms: float
    step_ms: float


def host_step_cost(device_bytes: float, host_bytes: float, memory_bandwidth: float, host_link_bandwidth: float,
                   num_layers: int) -> HostStepCost:
    """The cost of a decode step reading ``device_bytes`` of device-resident KV and ``host_bytes`` of cold KV.

    Bandwidths in bytes/s (``host_link_bandwidth`` host-to-device), byte counts over all layers,
    ``num_layers >= 1`` the pipeline depth. Raises ValueError on non-positive bandwidths or layers.
    """
    if memory_bandwidth <= 0 or host_link_bandwidth <= 0 or num_layers < 1:
        raise ValueError(f"bandwidths must be > 0 and num_layers >= 1, got {memory_bandwidth}, "
                         f"{host_link_bandwidth}, {num_layers}")
    gpu = (device_bytes + host_bytes) / memory_bandwidth * 1e3  # staged pages are read from device memory too
    transfer = host_bytes / host_link_bandwidth * 1e3
    step = max(gpu, transfer) + (min(gpu, transfer) / num_layers if host_bytes else 0.0)
    return HostStepCost(gpu_ms=gpu, transfer_ms=transfer, step_ms=step)
