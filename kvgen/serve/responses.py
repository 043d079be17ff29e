"""Engine outputs as OpenAI response bodies and stream chunks (completions and chat; no torch).

:class:`Choices` follows the completions of one HTTP request as outputs
arrive (choice ``prompt_index * n + completion_index``). The outputs are
the engine's deltas (``output_kind = "delta"``, merged per prompt by the
worker's Stream), so each update's text and tokens are exactly what is new
since the last chunk: the engine already holds back text that ends in an
incomplete UTF-8 character and, with stop strings, the last
``max(len(stop)) - 1`` characters (a stop string may still complete there);
the finished text is sent in full. For a whole (non-streamed) body the
choices keep the concatenated text, ids and logprobs.

Stream chunks are written by :meth:`Formatter.sse` from templates made once
per request (the same JSON as ``json.dumps(Formatter.chunk(...))``, compact):
at many clients the event loop writes one chunk per request and engine step,
so each must cost microseconds.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .prompts import Prompter


@dataclass
class _State:
    """One choice so far: tokens counted, the finish reason once sent, and (``keep``) everything received."""

    role_sent: bool = False
    finish_reason: str | None = None
    num_tokens: int = 0
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class Delta:
    """What is new for one choice: ``text``, ``token_ids`` with their ``logprobs`` entries, ``finish_reason``."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    first: bool


class Choices:
    """The choices of one request, built up from engine delta outputs; also counts usage.

    ``keep``: collect each choice's text, ids and logprobs for :meth:`Formatter.full`
    (a streamed response sends them as they come and needs only the counts).
    """

    def __init__(self, n: int, prompt_lengths: list[int], keep: bool = True) -> None:
        self.n = n
        self.keep = keep
        self.prompt_tokens = sum(prompt_lengths)
        self.states: dict[int, _State] = {}
        self.final: dict[int, _State] = {}  # choice index -> finished choice (text, token_ids, logprobs, reason)

    def update(self, prompt_index: int, out: Any, finished: bool) -> list[Delta]:
        """The chunks' deltas for ``out``, what is new in prompt ``prompt_index``'s completions (an engine delta)."""
        deltas = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            st = self.states.get(index)
            if st is None:
                st = self.states[index] = _State()
            done = finished or c.finish_reason is not None
            new, ids, lps = c.text, c.token_ids, c.logprobs
            if st.finish_reason is not None or (not new and not ids and not done and st.role_sent):
                continue  # nothing new (a finished choice among running ones, or a step that held its text back)
            reason = (c.finish_reason or "abort") if done else None
            deltas.append(Delta(index, new, ids, lps, reason, not st.role_sent))
            st.role_sent = True
            st.num_tokens += len(ids)
            if self.keep:
                st.pieces.append(new)
                st.token_ids.extend(ids)
                if lps is not None:
                    if st.logprobs is None:
                        st.logprobs = []
                    st.logprobs.extend(lps)
            if done:
                st.finish_reason = reason
                self.final[index] = st
        return deltas

    def usage(self) -> dict[str, int]:
        completion = sum(s.num_tokens for s in self.states.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_logprobs(prompter: Prompter, ids: list[int], lps: list[dict[int, float]] | None,
                        offset: int = 0) -> dict[str, Any] | None:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, lps):
        s = prompter.token_str(tid)
        tokens.append(s)
        token_lps.append(entry.get(tid))
        tops.append({prompter.token_str(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(prompter: Prompter, ids: list[int], lps: list[dict[int, float]] | None,
                  top: int) -> dict[str, Any] | None:
    """The chat API's logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if lps is None:
        return None

    def item(t: int, lp: float) -> dict[str, Any]:
        s = prompter.token_str(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, entry in zip(ids, lps):
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(tid, entry.get(tid, float("-inf"))), "top_logprobs": [item(t, lp) for t, lp in best]})
    return {"content": content}


_quote = json.encoder.encode_basestring_ascii  # json.dumps of a str (C), without dumps' per-call set-up


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class Formatter:
    """Builds the JSON bodies of one request for its endpoint (``chat`` or not)."""

    def __init__(self, chat: bool, model: str, prompter: Prompter, top_logprobs: int) -> None:
        self.chat = chat
        self.model = model
        self.prompter = prompter
        self.top = top_logprobs
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = f'data: {{"id":{_quote(self.id)},"object":"{obj}","created":{self.created},' \
                     f'"model":{_quote(model)},"choices":['

    def sse(self, deltas: list[Delta], usage: bool) -> str:
        """One server-sent event ``data: {chunk}\\n\\n``: :meth:`chunk`'s JSON, built from strings."""
        parts = []
        for d in deltas:
            lp = "null" if d.logprobs is None else _dumps(self._logprobs(d.index, d.token_ids, d.logprobs))
            reason = "null" if d.finish_reason is None else _quote(d.finish_reason)
            if self.chat:
                delta = ('{"role":"assistant","content":' + _quote(d.text) + "}" if d.first else
                         '{"content":' + _quote(d.text) + "}" if d.text else "{}")
                parts.append(f'{{"index":{d.index},"delta":{delta},"logprobs":{lp},"finish_reason":{reason}}}')
            else:
                parts.append(f'{{"index":{d.index},"text":{_quote(d.text)},"logprobs":{lp},"finish_reason":{reason}}}')
        return self._head + ",".join(parts) + ('],"usage":null}\n\n' if usage else "]}\n\n")

    def _logprobs(self, index: int, ids: list[int], lps: list[dict[int, float]] | None) -> Any:
        if self.chat:
            return chat_logprobs(self.prompter, ids, lps, self.top)
        out = completion_logprobs(self.prompter, ids, lps, self._offsets.get(index, 0))
        if out is not None:
            self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def chunk(self, deltas: list[Delta], usage: bool) -> dict[str, Any]:
        choices = []
        for d in deltas:
            lp = self._logprobs(d.index, d.token_ids, d.logprobs)
            if self.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": d.text} if d.first else (
                    {"content": d.text} if d.text else {})
                choices.append({"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
            else:
                choices.append({"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason})
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage}

    def full(self, choices: Choices) -> dict[str, Any]:
        items = []
        for index in sorted(choices.final):
            c = choices.final[index]
            lp = self._logprobs(index, list(c.token_ids), c.logprobs)
            reason = c.finish_reason or "abort"
            if self.chat:
                items.append({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                              "finish_reason": reason})
            else:
                items.append({"index": index, "text": c.text, "logprobs": lp, "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": items, "usage": choices.usage()}
