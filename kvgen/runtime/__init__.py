"""The thin runtime shipped inside every generated package (needs torch and triton only).

``load(plan, kernels, device=None, **kwargs)`` returns a :class:`KVCache`:
page pools allocated from the plan, a :class:`BlockManager`, and the
attention ops (``plan_step`` once per model step, then ``append_kv`` /
``decode`` / ``prefill`` per layer). Nothing here imports the rest of kvgen:
this folder is copied verbatim into ``generated/<plan>/runtime``.
"""

import importlib

# Name -> submodule. Exports load on first use, so a light import of one submodule (kvgen.env reads
# runtime/env.py) does not pull in torch through this package's __init__.
_EXPORTS = {
    "Autotuner": "autotune",
    "COMPRESSED": "block_manager", "RESIDUAL": "block_manager", "AppendPlan": "block_manager",
    "BlockManager": "block_manager",
    "KVCache": "cache", "PagePool": "page_pool", "default_device": "page_pool", "load": "cache", "pool_sizes": "page_pool",
    "KvgenRuntimeError": "errors", "OutOfPages": "errors", "UnknownSequence": "errors", "SwappedOut": "errors",
    "HOST_COMPRESSED": "tiering", "HOST_RESIDUAL": "tiering", "TransferPlan": "tiering",
    "allocate_pool": "pools", "pool_bytes": "pools",
    "StepMetadata": "step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
