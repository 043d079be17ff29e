"""Small host-to-device uploads that never wait for the device.

``torch.tensor(values, device="cuda")`` (and ``.to("cuda")`` of a pageable
tensor, or indexing a CUDA tensor with a Python list) copies from pageable
memory, which CUDA performs only after everything already queued on the
stream has run: the host stalls until the device is idle. With async
scheduling the queue holds the next step, so one such call per step undoes
the overlap. :func:`to_device` goes through pinned memory instead (the
caching host allocator keeps the pinned block until the copy has read it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a CPU tensor) as a ``dtype`` tensor on ``device``, queued without a host stall."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
