"""Requests and their sequences: the engine's bookkeeping (no torch).

A :class:`Sequence` is one completion's token list (prompt + output so far)
and how many of those tokens the cache holds (``num_computed``). A step
feeds ``tokens[num_computed : num_computed + n]``; when that reaches the
end of the list, the step's last row yields the logits of the next token.
The same rule covers a prompt chunk, a whole prompt, a decode token, and a
recompute after preemption (the sequence is freed, ``num_computed`` drops
to what the prefix cache still holds, and the tokens are fed again). A
sequence preempted by swap keeps ``num_computed``: its pages wait in the
host tier.
"""

from __future__ import annotations

import enum
from typing import Any

from .outputs import CompletionOutput, RequestMetrics
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # waiting with its pages in the host tier (preempted by swap)
    FINISHED = "finished"


class Sequence:
    """One completion of a request; ``seq_id`` = ``(request_id, index)`` is its id in the KV cache."""

    def __init__(self, request: "Request", index: int, tokens: list[int]) -> None:
        self.request = request
        self.index = index
        self.seq_id = (request.request_id, index)
        self.tokens = tokens
        self.num_computed = 0
        self.status = Status.WAITING
        self.completion = CompletionOutput(index=index)
        self.generator: Any = None  # a torch.Generator when the request has a seed (set by the engine)
        self.detok: Any = None  # an IncrementalDetokenizer once text is streamed or stop strings are checked
        self.text_len_sent = 0  # delta outputs: characters already handed out
        self.tokens_sent = 0  # delta outputs: output tokens already handed out

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        """A copy of the completion's tokens (O(length): per-step code uses :attr:`num_output`)."""
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.request.prompt_ids)

    @property
    def reserve(self) -> int:
        """Batch slots this sequence stands for: a prompt not yet forked into its ``n`` completions holds ``n``."""
        return self.request.params.n if self.index == 0 and not self.request.forked else 1

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, {len(self.tokens)} tokens, {self.num_computed} computed, {self.status.value})"


class Request:
    """A prompt with its sampling parameters and ``n`` sequences (one until the prompt is computed)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.forked = params.n == 1
        self.seqs = [Sequence(self, 0, list(prompt_ids))]
        self.num_cached_tokens = 0
        self._prompt_out: list[int] | None = None
        self.finished = False
        """Every sequence finished (before the fork: the first); kept by :meth:`refresh_finished`."""

    def prompt_out(self) -> list[int]:
        """The prompt ids the request's outputs carry: one copy, made on first use, shared by every output."""
        out = self._prompt_out
        if out is None:
            out = self._prompt_out = list(self.prompt_ids)
        return out

    def refresh_finished(self) -> bool:
        """Recompute :attr:`finished`; the engine calls it whenever one of the sequences finishes or aborts."""
        self.finished = (self.forked and all(s.status is Status.FINISHED for s in self.seqs)) or \
            (not self.forked and self.seqs[0].status is Status.FINISHED)
        return self.finished
