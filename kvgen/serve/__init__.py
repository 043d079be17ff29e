"""kvgen serve: an OpenAI-compatible HTTP server on kvgen's engine (FastAPI + uvicorn; the ``serve`` extra).

The server only translates HTTP into engine calls. Modules: ``protocol``
(request bodies, OpenAI-style errors), ``prompts`` (tokenizing, chat
template), ``worker`` (the one thread that calls the engine), ``responses``
(outputs as OpenAI bodies and stream chunks), ``metrics`` (Prometheus),
``app`` (the routes), ``server`` (uvicorn with a drain on SIGTERM), ``cli``
(``kvgen serve``).

Importing ``kvgen.serve`` imports neither torch nor fastapi.

    from kvgen.engine.loader import build_engine
    from kvgen.serve import build_app
    app = build_app(build_engine("path/to/model", kv="int8"), model_name="my-model")
"""

from __future__ import annotations

from typing import Any


def build_app(*args: Any, **kwargs: Any) -> Any:
    """:func:`kvgen.serve.app.build_app` (imported on first use)."""
    from .app import build_app as build

    return build(*args, **kwargs)


__all__ = ["build_app"]
