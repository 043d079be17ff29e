"""Incremental detokenization: a completion's text grows by decoding only its new tokens (no torch).

Decoding a completion's whole token list every step costs O(length) per
step, O(length^2) per request. :class:`IncrementalDetokenizer` (vLLM's
scheme) decodes ``ids[prefix:]`` and ``ids[prefix:read]`` -- the unread
tokens with a little left context, ``prefix..read`` being the tokens read
at the last emission -- and appends the difference. The left context keeps
what a tokenizer does at a boundary (SentencePiece's leading space, a
multi-token UTF-8 character) the same as in a whole decode. While the
decoded tail ends in ``'\\ufffd'`` (an incomplete UTF-8 sequence from
byte-fallback tokens) nothing is appended: the text never holds half a
character, and once the character completes it arrives whole.

Contract: :attr:`text` only grows (each value is a prefix of the next);
the engine takes a completion's final text from one whole decode at its
end, which equals the incremental text plus what was still held back
(tested with a byte-fallback tokenizer in tests/engine/test_detokenizer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """The text of a growing token list; call :meth:`update` with the whole list (it reads only the new ids)."""

    __slots__ = ("tokenizer", "skip_special_tokens", "text", "prefix", "read")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix = 0  # ids[prefix:read]: left context, decoded as of the last emission
        self.read = 0  # ids[:read] are in self.text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, ids: Sequence[int], end: int | None = None) -> str:
        """Read ``ids[read:end]`` (``end`` defaults to ``len(ids)``); returns the text appended (may be "")."""
        end = len(ids) if end is None else end
        if end <= self.read:
            return ""
        before = self._decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self._decode(ids[self.prefix:end])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet, or an incomplete UTF-8 character: wait for more tokens
        new = after[len(before):]
        self.text += new
        self.prefix, self.read = self.read, end
        return new
