"""Prompts to token ids on the event loop: texts, token-id lists, chats, and token strings for logprobs.

The server keeps its own copy of the engine's tokenizer (made before the
engine thread starts; with the engine in its own process, a copy sent from
there), so tokenizing here never touches the object the engine decodes
with. Texts are tokenized as ``LLM.generate`` does
(``tokenizer(text).input_ids``, special tokens added); a chat is rendered
with the tokenizer's chat template, as ``LLM.apply_chat_template`` does, and
tokenized without adding special tokens.

Models without a chat template (stories260K, base models) get
:data:`FALLBACK_CHAT_TEMPLATE` unless ``--chat-template FILE`` gives one:
BOS, then one ``role: content`` line per message, then ``assistant:``.
"""

from __future__ import annotations

import copy
from typing import Any

from .protocol import ApiError

FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The chat template used when the model's tokenizer has none (documented in ``kvgen serve --help``)."""


class Prompter:
    """Turns request prompts into token ids and checks them against the model (event loop only)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int | None, max_model_len: int,
                 chat_template: str | None = None) -> None:
        self.tokenizer = None if tokenizer is None else copy.deepcopy(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.chat_template = chat_template or own or FALLBACK_CHAT_TEMPLATE
        self._token_strs: dict[int, str] = {}

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                               param="prompt")
            ids = list(self.tokenizer(prompt).input_ids)
        else:
            ids = list(prompt)
            if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in ids):
                raise ApiError(400, f"prompt token ids must be in 0..{self.vocab_size - 1}", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty; give at least one token", param="prompt")
        return ids

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so it cannot take chat messages; use /v1/completions "
                                "with token ids")
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if not ids:
            raise ApiError(400, "the chat renders to no tokens", param="messages")
        return ids

    def max_tokens(self, requested: int | None, prompts: list[list[int]], param: str) -> int:
        """``requested`` checked against the context (default: what is left of it for the longest prompt)."""
        longest = max(len(p) for p in prompts)
        limit = self.max_model_len
        if requested is None:
            if longest >= limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                    f"has {longest} tokens, leaving none for the completion. Please shorten it.",
                               param=param)
            return limit - longest
        if longest + requested > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{longest + requested} tokens ({longest} in the prompt, {requested} for the "
                                f"completion). Please reduce the length of the prompt or {param}.", param=param)
        return requested

    def token_str(self, token_id: int) -> str:
        """The text of one token (for logprobs); ``token_id:N`` without a tokenizer."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s
