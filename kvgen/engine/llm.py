"""LLM: the offline entry point (vLLM's shape): ``LLM(path, kv="int4").generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .errors import EngineError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """A model on kvgen's KV cache with a continuous-batching engine.

    ``model``: a Hugging Face folder (config.json, safetensors, tokenizer),
    or a GGUF file (``"model.gguf"``, or a folder with ``gguf_file="name.gguf"``
    as in transformers; dequantized to ``dtype``, needs ``pip install 'kvgen[eval]'``).
    ``kv``: the KV scheme. ``dtype``: bfloat16/float16/float32 (default: the
    config's on a GPU, float32 on the CPU). ``max_num_seqs``,
    ``max_model_len``, ``max_tokens`` (KV capacity in tokens),
    ``max_num_batched_tokens``, ``device``, ``enforce_eager`` (no CUDA
    graphs), ``tp`` (tensor-parallel ranks: processes on GPUs 0..tp-1, or
    on the CPU), ``host_tokens`` (a host-memory KV tier: preemption by swap),
    ``preemption_mode``, ``async_scheduling`` (plan each decode step while
    the GPU runs the previous one); see :func:`kvgen.engine.loader.build_engine`.
    ``llm.engine`` is the :class:`LLMEngine` (``add_request``/``step``/``abort_request``).
    ``close()`` (or ``with LLM(...) as llm``) stops tensor-parallel workers
    at once; otherwise they stop when the LLM is collected or at exit.
    """

    def __init__(self, model: str | None = None, kv: str = "int8", **kwargs: Any) -> None:
        from .loader import build_engine

        self.engine = build_engine(model, kv=kv, **kwargs)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete every prompt (texts or token-id lists); outputs in prompt order."""
        prompts = self._as_list(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise EngineError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        eng = self.engine
        ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        previous, eng.output_kind = eng.output_kind, "final"  # no per-step snapshots: O(1) host work per token
        try:
            while len(done) < len(ids):
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                eng.abort_request(rid)
            raise
        finally:
            eng.output_kind = previous
        return [done[r] for r in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (texts so far); the last one is finished.

        Closing the iterator early aborts the request.
        """
        eng = self.engine
        if eng.output_kind != "cumulative":
            raise EngineError(f"LLM.stream needs the engine's output_kind 'cumulative', not {eng.output_kind!r}")
        rid = eng.add_request(None, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in eng.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                eng.abort_request(rid)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (``[{"role": "user", "content": ...}]``) with the generation prompt."""
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise EngineError("this model's tokenizer has no chat template; pass a plain prompt instead")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False).input_ids)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (through the chat template)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)
