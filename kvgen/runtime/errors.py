"""Errors the runtime raises at an application.

This module lives in the runtime, which is copied into every generated
package and may import nothing from the rest of kvgen; so these errors do not
derive from ``kvgen.errors.KvgenError``. Each message is one line that says
what was wrong and what to do.
"""

from __future__ import annotations


class KvgenRuntimeError(Exception):
    """Base class of every user-facing runtime error. The message is one line."""


class OutOfPages(KvgenRuntimeError):
    """A page pool has no free or evictable page left for a request.

    Raised before any state changes, so the caller can preempt (free) a
    sequence and retry the same call.
    """


class UnknownSequence(KvgenRuntimeError):
    """A sequence id that was never added, or was already freed."""
