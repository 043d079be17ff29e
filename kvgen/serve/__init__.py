"""kvgen serve: an OpenAI-compatible HTTP server on kvgen's engine (FastAPI + uvicorn; the ``serve`` extra).

The server only translates HTTP into engine calls. Modules: ``protocol``
(request bodies, OpenAI-style errors), ``prompts`` (tokenizing, chat
template), ``engine_loop`` (the step loop around the engine: commands
between steps, drain, failure), ``stats`` (what the metrics need from the
engine, as plain data), ``worker`` (the workers' shared asyncio side, and
the engine on a thread of this process), ``engine_process`` /
``engine_child`` / ``channel`` (the engine in a process of its own, what
``kvgen serve`` runs by default), ``stream`` (a request's outputs as they
arrive), ``responses`` (outputs as OpenAI bodies and stream chunks),
``metrics`` (Prometheus), ``app`` (the routes), ``server`` (uvicorn with a
drain on SIGTERM), ``cli`` (``kvgen serve``).

Importing ``kvgen.serve`` imports neither torch nor fastapi.

    from kvgen.serve import build_app
    from kvgen.serve.engine_process import EngineSpec
    # the engine in a process of its own (built there), as `kvgen serve` runs it:
    app = build_app(EngineSpec("kvgen.engine.loader:build_engine", {"model": "path/to/model", "kv": "int8"}),
                    model_name="my-model")
    # or an engine built here, run on a thread of this process:
    from kvgen.engine.loader import build_engine
    app = build_app(build_engine("path/to/model", kv="int8"), model_name="my-model")
"""

from __future__ import annotations

from typing import Any


def build_app(*args: Any, **kwargs: Any) -> Any:
    """:func:`kvgen.serve.app.build_app` (imported on first use)."""
    from .app import build_app as build

    return build(*args, **kwargs)


__all__ = ["build_app"]
