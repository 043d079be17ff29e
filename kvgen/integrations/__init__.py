"""Integrations of the kvgen runtime with model libraries.

- :mod:`kvgen.integrations.transformers`: ``attach(model, scheme=...)`` makes
  Hugging Face ``model.generate(...)`` run on kvgen pages and kernels.

Submodules import their library lazily; ``kvgen.integrations.attach`` is a
shortcut to the transformers one.
"""

from __future__ import annotations

from typing import Any


def attach(model: Any, *args: Any, **kwargs: Any):
    """``kvgen.integrations.transformers.attach`` (imports transformers on first use)."""
    from kvgen.integrations.transformers import attach as _attach

    return _attach(model, *args, **kwargs)


__all__ = ["attach"]
