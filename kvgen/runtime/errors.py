"""Errors the runtime raises at an application.

This module lives in the runtime, which is copied into every generated
package and may import nothing from the rest of kvgen; so these errors do not
derive from ``kvgen.errors.KvgenError``. Each message is one line that says
what was wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def append_tokens(token_ids: Sequence[int] | None, expected: int | None) -> list[int] | None:
    """An append's token ids as ints (or None), checked to number ``expected``."""
    if token_ids is None:
        return None
    tokens = token_list(token_ids, "append")
    if expected is not None and len(tokens) != expected:
        raise KvgenRuntimeError(
            f"append got {len(tokens)} token ids for {expected} tokens; pass one id per token or None")
    return tokens


def step_args(seq_ids: tuple, num_new: Sequence[int],
              token_ids: Sequence[Sequence[int] | None] | None) -> tuple[list[int], list]:
    """Validate a step's arguments (nothing changes); returns the counts and per-sequence token lists."""
    if isinstance(num_new, (str, bytes)) or not isinstance(num_new, Sequence):
        raise KvgenRuntimeError(f"reserve_step token counts must be a list of ints, got {num_new!r}")
    if len(num_new) != len(seq_ids):
        raise KvgenRuntimeError(
            f"plan_step got {len(seq_ids)} sequence ids and {len(num_new)} token counts; "
            f"pass one count per sequence")
    if len(set(seq_ids)) != len(seq_ids):
        raise KvgenRuntimeError("plan_step got a sequence id twice; each sequence appears once per step")
    counts = []
    for n in num_new:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise KvgenRuntimeError(f"plan_step token counts must be ints >= 0, got {n!r}")
        counts.append(int(n))
    if token_ids is None:
        return counts, [None] * len(seq_ids)
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise KvgenRuntimeError(
            f"plan_step token_ids must be a list with one list of ids (or None) per sequence, "
            f"got a {type(token_ids).__name__}")
    if len(token_ids) != len(seq_ids):
        raise KvgenRuntimeError(
            f"plan_step got token ids for {len(token_ids)} sequences, expected {len(seq_ids)} (or None)")
    toks: list = []
    for sid, ids, n in zip(seq_ids, token_ids, counts):
        ids = None if ids is None else token_list(ids, f"plan_step, sequence {sid!r}")
        if ids is not None and len(ids) != n:
            raise KvgenRuntimeError(
                f"plan_step: sequence {sid!r} adds {n} tokens but got {len(ids)} token ids")
        toks.append(ids)
    return counts, toks


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
