"""What the engine hands back: RequestOutput with CompletionOutputs, shaped like vLLM's (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request: ``text``, ``token_ids``, ``finish_reason`` (None while running;
    ``"stop"``, ``"length"`` or ``"abort"``), ``stop_reason`` (the stop string or token id that ended it),
    and with ``logprobs`` set, per token a dict ``{token_id: logprob}`` (sampled token and top-n)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter()`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step: ``outputs[i]`` per completion (``n`` of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
