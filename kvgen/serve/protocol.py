"""The OpenAI request bodies kvgen serve accepts, and OpenAI-style errors (pydantic; no torch).

Bodies are parsed with :meth:`pydantic.BaseModel.model_validate_json` in
strict mode, so malformed JSON and wrong types (``"max_tokens": "5"``) are
both a :class:`ApiError` with status 400, as OpenAI answers them. Unknown
fields are ignored (the official client sends some we do not use, e.g.
``user``). vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``) are accepted at the top
level, which is where the client's ``extra_body`` puts them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_LOGPROBS = 20
"""The most top log-probabilities a request may ask for (OpenAI's limit)."""


class ApiError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole: the engine process sends it back as it is
        return (type(self), (self.status, self.message, self.type, self.param, self.headers))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields common to both endpoints (OpenAI's names, vLLM's extensions)."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_kwargs(self, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments of the engine's SamplingParams (None fields keep the engine's defaults)."""
        kw: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "min_tokens": min(self.min_tokens, max_tokens),
                              "ignore_eos": self.ignore_eos, "logprobs": logprobs, "seed": self.seed,
                              "stop": self.stop, "stop_token_ids": self.stop_token_ids or []}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, a list of texts, token ids or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise ApiError(400, "echo is not supported by kvgen serve", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by kvgen serve", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of other than n is not supported by kvgen serve", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request (choice ``i * n + j`` is completion ``j`` of prompt ``i``)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[_Sampling], raw: bytes) -> Any:
    """``raw`` as a ``model`` instance, or ApiError 400 naming the first bad field."""
    try:
        req = model.model_validate_json(raw or b"")
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {err['msg']}") from None
        loc = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}" if loc else err["msg"], param=loc or None) from None
    req.check()
    return req
