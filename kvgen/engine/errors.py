"""Errors a user of the engine can cause (a subclass of kvgen's KvgenError: the CLI prints one line)."""

from __future__ import annotations

from kvgen.errors import KvgenError


class EngineError(KvgenError):
    """A model the engine cannot run, a bad argument to LLM/SamplingParams, or a request it cannot serve."""
