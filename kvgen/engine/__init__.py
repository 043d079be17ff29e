"""kvgen's serving engine: continuous batching, chunked prefill, preemption and sampling over the runtime.

Layers (each a module): ``config`` (ModelConfig from config.json), ``model``
/ ``weights`` / ``rope`` (the Llama-family decoder in torch), ``runner``
and ``graphs`` (a step through the model, decode in CUDA graphs),
``scheduler`` / ``sequence`` (who runs each step), ``sampler`` /
``sampling_params`` (next tokens), ``engine`` (LLMEngine: add_request /
step / abort_request) with ``engine_outputs`` (what a step returns: deltas,
snapshots, decoded text), ``llm`` (LLM: generate / stream / chat), ``cli``
(``kvgen generate``); tensor parallelism: ``shard`` (a rank's share of the
weights), ``parallel`` (ranks as processes, rank 0's cache calls replayed
on the others; loaded only for tp > 1) and ``worker`` (a rank's entry point).
The runtime never imports this package.

Importing ``kvgen.engine`` does not import torch: the names below load on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "llm",
    "LLMEngine": "engine",
    "SamplingParams": "sampling_params",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    "EngineError": "errors",
    "ModelConfig": "config",
    "build_engine": "loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
