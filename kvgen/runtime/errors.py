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


class SwappedOut(KvgenRuntimeError):
    """A step names a sequence whose pages are in the host tier; ``swap_in`` it first."""


# -- checks of caller input (shared by the block manager and KVCache) ---------------
def check_seq_id(seq_id: object) -> None:
    """Raise KvgenRuntimeError unless ``seq_id`` can name a sequence (it must be hashable)."""
    try:
        hash(seq_id)
    except TypeError:
        raise KvgenRuntimeError(
            f"sequence ids must be hashable (a str, an int, a tuple), got a {type(seq_id).__name__}: "
            f"{_short(seq_id)}") from None


def seq_id_list(seq_ids: object, what: str) -> tuple:
    """``seq_ids`` as a tuple, refusing a lone str/bytes (it would split into characters) and non-sequences."""
    if isinstance(seq_ids, (str, bytes)):
        raise KvgenRuntimeError(
            f"{what} takes a list of sequence ids, got the string {_short(seq_ids)}; pass [{_short(seq_ids)}] "
            f"for one sequence")
    try:
        ids = tuple(seq_ids)  # type: ignore[arg-type]
    except TypeError:
        raise KvgenRuntimeError(
            f"{what} takes a list of sequence ids, got a {type(seq_ids).__name__}: {_short(seq_ids)}") from None
    for sid in ids:
        check_seq_id(sid)
    return ids


def token_list(token_ids: object, what: str) -> list[int]:
    """Token ids as a list of Python ints; refuses a str, floats (1.7 is not token 1) and non-sequences."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise KvgenRuntimeError(
            f"{what}: token ids must be a list of ints, got a {type(token_ids).__name__}: {_short(token_ids)}")
    if hasattr(token_ids, "tolist"):  # a tensor or an array: one conversion, not one per element
        token_ids = token_ids.tolist()
        if not isinstance(token_ids, list):
            token_ids = [token_ids]
    out = []
    for i, t in enumerate(token_ids):  # type: ignore[union-attr]
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(int(t.__index__()))
        except (AttributeError, TypeError):
            raise KvgenRuntimeError(
                f"{what}: token ids must be ints, got {_short(t)} ({type(t).__name__}) at position {i}; "
                f"pass the tokenizer's integer ids") from None
    return out


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
