"""What LLMEngine.step returns: each changed request's output, as a snapshot, a delta or only when finished.

:class:`OutputsMixin` (a mixin of :class:`~.engine.LLMEngine`) builds the
:class:`RequestOutput` of each request a step changed, in the engine's
:attr:`~OutputsMixin.output_kind`, and decodes completion texts: whole at
the end (``_text``), incrementally while streaming or checking stop
strings (``_running_text``, through :class:`~.detokenizer.IncrementalDetokenizer`).
Finished requests leave ``engine.requests`` once their output is collected.
"""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer
from .errors import EngineError
from .outputs import CompletionOutput, RequestOutput
from .sequence import Request, Sequence


class OutputsMixin:
    """Output methods of LLMEngine (it provides requests, tokenizer, stream_text and _output_kind)."""

    OUTPUT_KINDS = ("cumulative", "delta", "final")

    @property
    def output_kind(self) -> str:
        """What :meth:`step` returns for a request that changed.

        ``"cumulative"`` (the default): a snapshot -- every token, logprob and
        (with :attr:`stream_text`) the text so far; O(length) per output.
        ``"delta"``: only what is new since the request's last output (token
        ids, logprobs, text; ``cumulative_logprob`` is the running total) and
        ``finished``; O(new tokens) per output. Concatenated, the deltas are
        the cumulative output. Text is held back while it ends in an
        incomplete UTF-8 character, and, with stop strings, its last
        ``max(len(stop)) - 1`` characters (a stop string may still complete
        there and is then cut).
        ``"final"``: nothing until a request finishes, then its full output.
        :meth:`output_of` always gives the full snapshot, :meth:`delta_of`
        what is new since the last delta.
        """
        return self._output_kind

    @output_kind.setter
    def output_kind(self, kind: str) -> None:
        if kind not in self.OUTPUT_KINDS:
            raise EngineError(f"output_kind must be one of {', '.join(self.OUTPUT_KINDS)}, not {kind!r}")
        self._output_kind = kind

    def _text(self, seq: Sequence) -> str:
        """The whole completion decoded at once (its final text)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.request.params.skip_special_tokens)

    def _running_text(self, seq: Sequence) -> str:
        """The completion's text so far, decoded incrementally (without a trailing incomplete character)."""
        if self.tokenizer is None:
            return ""
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.request.params.skip_special_tokens)
        seq.detok.update(_Window(seq.tokens, seq.num_prompt))
        return seq.detok.text

    def _collect(self, changed: dict[str, Request]) -> list[RequestOutput]:
        outs = []
        kind = self._output_kind
        for rid, req in changed.items():
            if kind == "cumulative":
                outs.append(self.output_of(req, text=self.stream_text))
            elif kind == "delta":
                outs.append(self.delta_of(req))
            elif req.finished:
                outs.append(self.output_of(req))
            if req.finished:
                self.requests.pop(rid, None)
        return outs

    def delta_of(self, req: Request) -> RequestOutput:
        """What is new in ``req`` since its last delta output (see :attr:`output_kind`), and marks it sent.

        The first call gives everything so far. After :meth:`abort_request`
        (take ``req`` from ``requests`` first: the abort removes it) it is
        exactly the rest that the delta outputs have not carried -- tokens
        of the step in flight, text held back -- with finish reason ``abort``:
        a server that streamed the deltas ends the request with it.
        """
        comps = []
        holdback = max((len(s) for s in req.params.stop), default=1) - 1 if req.params.stop else 0
        for seq in (req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=_by_index)):
            c = seq.completion
            start, end = seq.tokens_sent, seq.num_output
            p0 = seq.num_prompt
            ids = seq.tokens[p0 + start:p0 + end]
            lps = None if c.logprobs is None else c.logprobs[start:end]
            seq.tokens_sent = end
            if c.finish_reason is not None:
                full = c.text
            elif self.tokenizer is not None:
                full = self._running_text(seq)
                full = full[:max(len(full) - holdback, seq.text_len_sent)]
            else:
                full = ""
            # a finished text is a whole decode; it extends what was streamed (see .detokenizer)
            text = full[seq.text_len_sent:]
            seq.text_len_sent = max(seq.text_len_sent, len(full))
            comps.append(CompletionOutput(c.index, text, ids, c.cumulative_logprob, lps, c.finish_reason,
                                          c.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_out(), comps, req.finished, req.metrics,
                             req.num_cached_tokens)

    def output_of(self, req: Request, text: bool = True) -> RequestOutput:
        """A snapshot of ``req`` (texts decoded for running sequences only when ``text``).

        The completion lists are the output's own copies. ``prompt_token_ids``
        is one copy of the prompt made once per request and shared by all its
        outputs (as vLLM's): copying a long prompt into every output of every
        step cost more than the rest of the step at large batches. The engine
        never reads that copy, so changing it cannot change the request.
        """
        comps = []
        seqs = req.seqs if len(req.seqs) == 1 else sorted(req.seqs, key=_by_index)
        for seq in seqs:
            c = seq.completion
            if c.finish_reason is None and text:
                c.text = self._running_text(seq)
            comps.append(CompletionOutput(c.index, c.text, seq.output_ids, c.cumulative_logprob,
                                          None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                                          c.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_out(), comps, req.finished, req.metrics,
                             req.num_cached_tokens)


class _Window:
    """``tokens[offset:]`` as a sliceable sequence without copying it (slices copy only what they cover)."""

    __slots__ = ("tokens", "offset")

    def __init__(self, tokens: list[int], offset: int) -> None:
        self.tokens = tokens
        self.offset = offset

    def __len__(self) -> int:
        return len(self.tokens) - self.offset

    def __getitem__(self, s: slice) -> list[int]:
        o = self.offset
        return self.tokens[o + (s.start or 0):o + (len(self) if s.stop is None else s.stop)]


def _by_index(seq: Sequence) -> int:
    return seq.index
