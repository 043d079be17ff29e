"""SamplingParams: how to pick each next token and when to stop (vLLM's names and meanings; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import EngineError


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    ``temperature`` 0 means greedy (argmax). ``top_k`` (0 or -1: off),
    ``top_p`` (1: off) and ``min_p`` (0: off) filter the distribution after
    temperature. ``repetition_penalty`` (1: off) divides positive / multiplies
    negative logits of every token already in the prompt or output;
    ``presence_penalty`` and ``frequency_penalty`` (0: off) subtract from the
    logits of output tokens (once, and per occurrence). ``seed`` gives the
    request its own generator (reproducible whatever else is batched with it).
    Generation stops at ``max_tokens`` (finish reason ``length``), at a token
    of ``stop_token_ids`` or the model's EOS unless ``ignore_eos`` (``stop``),
    or when the text contains one of ``stop`` (``stop``; the text is cut
    before it). ``n`` completions share the prompt's pages (forks).
    ``logprobs``: also return the sampled token's and the top-``logprobs``
    tokens' log-probabilities (of the model's raw distribution, as vLLM).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be an int >= -1 (0/-1 = off), got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be an int >= 0, got {self.min_tokens!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be an int >= 0 or None, got {self.logprobs!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise EngineError(f"SamplingParams: {msg}")
        if any(not s for s in self.stop):
            raise EngineError("SamplingParams: stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
