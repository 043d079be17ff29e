"""LLMEngine: requests in, RequestOutputs out, one model step per :meth:`step` (what a server drives).

    engine.add_request("r1", "Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # requests that changed this step
            print(out.request_id, out.outputs[0].text)
    engine.abort_request("r2")             # frees its pages at once

Each step: the scheduler picks the batch and plans it in the runtime, the
runner computes logits for the sequences that reach their last token, the
sampler draws, and stop conditions finish sequences (their pages return to
the pool). A request with ``n > 1`` computes its prompt once; when the
prompt's logits arrive, ``n`` tokens are drawn and the sequence is forked
in the cache (the completions share the prompt's pages).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from .errors import EngineError
from .outputs import CompletionOutput, RequestOutput
from .runner import ModelRunner
from .sampler import SampleSlot, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence, Status


class LLMEngine:
    """Continuous-batching engine over one model and one KVCache.

    ``runner``: anything with ``run(step, input_ids, positions, sample_rows)
    -> logits`` (a :class:`ModelRunner`; tests may pass a stand-in).
    ``tokenizer``: a Hugging Face tokenizer, or None (then prompts are token
    ids and texts stay empty). ``eos_token_ids``: ids that end a completion
    unless ``ignore_eos``. ``preemption_mode``: ``"swap"`` (the default when
    ``cache.host_tier`` exists) or ``"recompute"`` (see :mod:`.scheduler`).
    """

    def __init__(self, runner: Any, cache: Any, tokenizer: Any = None, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: Seq[int] = (), vocab_size: int | None = None,
                 preemption_mode: str | None = None) -> None:
        self.runner = runner
        self.cache = cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.scheduler = Scheduler(cache, max_num_seqs, max_num_batched_tokens, preemption_mode)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.peak_running = 0
        self.stream_text = True
        """Decode the text of running completions into every step's outputs (off: only finished ones; faster)."""

    # -- requests ---------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError("this engine has no tokenizer; pass prompts as lists of token ids")
        return list(self.tokenizer(prompt).input_ids)

    def add_request(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a prompt (text, or token ids); returns its request id (generated when None)."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use; pick another one")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise EngineError("the prompt is empty; give at least one token")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in ids):
            raise EngineError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"the prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}; "
                              f"shorten it or raise max_model_len")
        if params.n > self.scheduler.max_num_seqs:
            raise EngineError(f"n={params.n} completions exceed max_num_seqs={self.scheduler.max_num_seqs}; "
                              f"lower n or raise max_num_seqs")
        req = Request(request_id, text, ids, params, time.perf_counter() if arrival_time is None else arrival_time)
        self._seed(req.seqs[0])
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def _seed(self, seq: Sequence) -> None:
        seed = seq.request.params.seed
        if seed is not None:
            seq.generator = torch.Generator(device=self.cache.device).manual_seed(seed + 7919 * seq.index)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (finish reason ``abort``) and free its pages; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.remove(seq)
                seq.completion.finish_reason = "abort"

    def close(self) -> None:
        """Release what the runner holds beyond this process (tensor-parallel workers); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the outputs of requests that got tokens (or finished) in it."""
        sched = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for seq in self.scheduler.truncated:
            self._finish(seq, "length", None)
            changed[seq.request.request_id] = seq.request
        self.scheduler.truncated.clear()
        if sched is None:
            return self._collect(changed)
        self.num_steps += 1
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        now = time.perf_counter()
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for seq, n, last in zip(sched.seqs, sched.num_new, sched.sample):
            c = seq.num_computed
            ids.extend(seq.tokens[c:c + n])
            pos.extend(range(c, c + n))
            if last:
                rows.append(len(ids) - 1)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        if sched.swapped:  # pages moved between the tiers while planning: no CUDA graph for this step
            eager = getattr(self.runner, "eager_once", None)
            if eager is not None:
                eager()
        logits = self.runner.run(sched.step, ids, pos, rows)
        for seq, n in zip(sched.seqs, sched.num_new):
            seq.num_computed += n
        slots: list[SampleSlot] = []
        owners: list[Sequence] = []
        forks: list[tuple[Sequence, list[Sequence]]] = []
        r = 0
        for seq, last in zip(sched.seqs, sched.sample):
            if not last:
                continue
            req = seq.request
            group = [seq]
            if not req.forked:
                children = [Sequence(req, i, list(req.prompt_ids)) for i in range(1, req.params.n)]
                for ch in children:
                    self._seed(ch)
                forks.append((seq, children))
                group += children
            for s in group:
                slots.append(SampleSlot(r, req.params, s.generator, req.prompt_ids, s.output_ids,
                                        self._banned(s)))
                owners.append(s)
            r += 1
        drawn = sample(logits, slots) if slots else []
        for parent, children in forks:  # fork before anything finishes: the children need the prompt's pages
            req = parent.request
            for ch in children:
                ch.num_computed = parent.num_computed
                self.cache.fork(parent.seq_id, ch.seq_id)
            self.scheduler.add_forks(parent, children)
            req.seqs.extend(children)
            req.forked = True
        now = time.perf_counter()
        for seq, d in zip(owners, drawn):
            req = seq.request
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            seq.tokens.append(d.token)
            comp = seq.completion
            if d.logprob is not None:
                comp.logprobs = (comp.logprobs or []) + [d.top_logprobs]
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + d.logprob
            self._check_stop(seq, d.token)
            changed[req.request_id] = req
        return self._collect(changed)

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.request.params
        if len(seq.output_ids) >= p.min_tokens:
            return ()
        return tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)))

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.request.params.skip_special_tokens)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.request.params
        out = seq.output_ids
        if len(out) >= p.min_tokens:
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
        if p.stop and len(out) >= p.min_tokens:
            text = self._text(seq)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                seq.completion.text = text[:at]
                return self._finish(seq, "stop", s, text_done=True)
        if p.max_tokens is not None and len(out) >= p.max_tokens:
            return self._finish(seq, "length", None)
        if len(seq.tokens) >= self.max_model_len:
            return self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: Any, text_done: bool = False) -> None:
        self.scheduler.remove(seq)
        seq.completion.finish_reason = reason
        seq.completion.stop_reason = stop_reason
        if not text_done:
            seq.completion.text = self._text(seq)
        req = seq.request
        if req.finished:
            req.metrics.finished_time = time.perf_counter()

    def _collect(self, changed: dict[str, Request]) -> list[RequestOutput]:
        outs = []
        for rid, req in changed.items():
            outs.append(self.output_of(req, text=self.stream_text))
            if req.finished:
                self.requests.pop(rid, None)
        return outs

    def output_of(self, req: Request, text: bool = True) -> RequestOutput:
        """A snapshot of ``req`` (texts decoded for running sequences only when ``text``)."""
        comps = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            c = seq.completion
            if c.finish_reason is None and text:
                c.text = self._text(seq)
            comps.append(CompletionOutput(c.index, c.text, list(seq.output_ids), c.cumulative_logprob,
                                          None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                                          c.stop_reason))
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), comps, req.finished, req.metrics,
                             req.num_cached_tokens)
