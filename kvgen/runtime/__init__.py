"""The thin runtime shipped inside every generated package (needs torch and triton only).

``load(plan, kernels, device=None, **kwargs)`` returns a :class:`KVCache`:
page pools allocated from the plan, a :class:`BlockManager`, and the
attention ops (``plan_step`` once per model step, then ``append_kv`` /
``decode`` / ``prefill`` per layer). Nothing here imports the rest of kvgen:
this folder is copied verbatim into ``generated/<plan>/runtime``.
"""

from .autotune import Autotuner
from .block_manager import COMPRESSED, RESIDUAL, AppendPlan, BlockManager
from .cache import KVCache, PagePool, default_device, load, pool_sizes
from .errors import KvgenRuntimeError, OutOfPages, UnknownSequence
from .pools import allocate_pool, pool_bytes
from .step import StepMetadata

__all__ = [
    "COMPRESSED", "RESIDUAL", "AppendPlan", "Autotuner", "BlockManager", "KVCache", "KvgenRuntimeError",
    "OutOfPages", "PagePool", "StepMetadata", "UnknownSequence", "allocate_pool", "default_device", "load", "pool_bytes",
    "pool_sizes",
]
