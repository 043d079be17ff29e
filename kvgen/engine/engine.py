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
in the cache (the completions share the prompt's pages). With
``async_scheduling`` the host plans decode step n+1 while the device runs
step n, and reads step n's tokens afterwards (a one-step lag).

This module holds requests, the step loop, async scheduling and stop
conditions; what :meth:`LLMEngine.step` returns (snapshot/delta/final
outputs, completion texts) is built in :mod:`.engine_outputs`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from .engine_outputs import OutputsMixin
from .errors import EngineError
from .outputs import RequestOutput
from .runner import ModelRunner
from .sampler import PendingSample, SampleSlot, sample_async
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence, Status
from .upload import to_device


class LLMEngine(OutputsMixin):
    """Continuous-batching engine over one model and one KVCache.

    ``runner``: anything with ``run(step, input_ids, positions, sample_rows)
    -> logits`` (a :class:`ModelRunner`; tests may pass a stand-in).
    ``tokenizer``: a Hugging Face tokenizer, or None (then prompts are token
    ids and texts stay empty). ``eos_token_ids``: ids that end a completion
    unless ``ignore_eos``. ``preemption_mode``: ``"swap"`` (the default when
    ``cache.host_tier`` exists) or ``"recompute"`` (see :mod:`.scheduler`).
    ``async_scheduling``: plan steady decode steps while the device runs the
    previous one (see :attr:`async_scheduling`; off by default).
    """

    def __init__(self, runner: Any, cache: Any, tokenizer: Any = None, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: Seq[int] = (), vocab_size: int | None = None,
                 preemption_mode: str | None = None, async_scheduling: bool = False) -> None:
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
        self.num_async_steps = 0
        """Steps planned and launched while the step before was in flight (see :attr:`async_scheduling`)."""
        self.num_decode_steps = 0
        """Steps that ran one token of every scheduled sequence and nothing else (no prompt chunk)."""
        self.num_decode_tokens = 0
        """Tokens those steps ran (their batch sizes, summed)."""
        self.peak_running = 0
        self.stream_text = True
        """Decode the text of running completions into every step's outputs (off: only finished ones; faster)."""
        self._output_kind = "cumulative"
        self._inflight: _InFlight | None = None
        self._late: dict[str, Request] = {}  # requests changed by a drain outside step(): its next outputs
        self.async_scheduling = async_scheduling

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
                self._remove(seq)
                seq.completion.finish_reason = "abort"
                seq.completion.text = self._text(seq)
        req.refresh_finished()
        cur = self._inflight
        if cur is not None and not any(s.status is Status.RUNNING for s in cur.seqs):
            self._drain(self._late)  # nothing of it is live any more: free its pages now (no step() may follow)

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
        """Run one model step; returns the outputs of requests that got tokens (or finished) in it.

        With :attr:`async_scheduling`, a steady decode step's tokens come out
        of the call after the one that launched it.
        """
        changed, self._late = self._late, {}
        prev = self._inflight
        if prev is not None:
            # its rows still running (the rest finished or were aborted while it ran): found once per step
            rows = [i for i, s in enumerate(prev.seqs) if s.status is Status.RUNNING]
            nxt = self.scheduler.schedule_continuation([prev.seqs[i] for i in rows])
            if nxt is not None:
                self._continue(prev, rows, nxt, changed)
                return self._collect(changed)
            self._drain(changed)  # not steady decode: the synchronous path, from a settled state
        sched = self.scheduler.schedule()
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
            if n == 1:  # a decode token: no slices
                ids.append(seq.tokens[c])
                pos.append(c)
            else:
                ids.extend(seq.tokens[c:c + n])
                pos.extend(range(c, c + n))
            if last:
                rows.append(len(ids) - 1)
            metrics = seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if sched.swapped:  # pages moved between the tiers while planning: no CUDA graph for this step
            eager = getattr(self.runner, "eager_once", None)
            if eager is not None:
                eager()
        logits = self.runner.run(sched.step, ids, pos, rows)
        self._count_decode(sched.step)
        for seq, n in zip(sched.seqs, sched.num_new):
            seq.num_computed += n
        slots, owners, forks = self._slots(sched)
        pending = sample_async(logits, slots) if slots else None
        if pending is not None and self._async and not forks and not sched.swapped and \
                len(owners) == len(sched.seqs) and all(n == 1 for n in sched.num_new):
            # steady decode: leave it in flight; the next call plans its successor before reading it
            self._inflight = _InFlight(sched.seqs, pending)
            return self._collect(changed)
        drawn = pending.result() if pending is not None else []
        for parent, children in forks:  # fork before anything finishes: the children need the prompt's pages
            req = parent.request
            for ch in children:
                ch.num_computed = parent.num_computed
                self.cache.fork(parent.seq_id, ch.seq_id)
            self.scheduler.add_forks(parent, children)
            req.seqs.extend(children)
            req.forked = True
        self._apply(owners, drawn, changed)
        return self._collect(changed)

    def _slots(self, sched: Any) -> tuple[list[SampleSlot], list[Sequence], list[tuple[Sequence, list[Sequence]]]]:
        """The draws of a launched step: slots, the sequence each token goes to, and the forks to make."""
        slots: list[SampleSlot] = []
        owners: list[Sequence] = []
        forks: list[tuple[Sequence, list[Sequence]]] = []
        r = 0
        for seq, last in zip(sched.seqs, sched.sample):
            if not last:
                continue
            req = seq.request
            params = req.params
            if req.forked:
                group = (seq,)
            else:
                children = [Sequence(req, i, list(req.prompt_ids)) for i in range(1, params.n)]
                for ch in children:
                    self._seed(ch)
                forks.append((seq, children))
                group = (seq, *children)
            history = _uses_history(params)
            for s in group:
                # banned ids only before min_tokens (num_output is O(1); _banned builds a set)
                banned = self._banned(s) if params.min_tokens and s.num_output < params.min_tokens else ()
                slots.append(SampleSlot(r, params, s.generator, req.prompt_ids, s.output_ids if history else _NONE,
                                        banned))
                owners.append(s)
            r += 1
        return slots, owners, forks

    def _apply(self, owners: Seq[Sequence], drawn: Seq[Any], changed: dict[str, Request]) -> None:
        """Append the drawn tokens to their sequences and check the stop conditions.

        A sequence that finished or was aborted while its token was in flight
        (async scheduling) takes nothing.
        """
        now = time.perf_counter()
        for seq, d in zip(owners, drawn):
            if seq.status is Status.FINISHED:
                continue
            req = seq.request
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            seq.tokens.append(d.token)
            comp = seq.completion
            if d.logprob is not None:
                if comp.logprobs is None:
                    comp.logprobs = []
                comp.logprobs.append(d.top_logprobs)
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + d.logprob
            self._check_stop(seq, d.token)
            changed[req.request_id] = req

    # -- async scheduling ----------------------------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        """Plan each steady decode step while the device runs the one before (vLLM V1's one-step lag).

        A decode step of the same batch as the step in flight (every sequence
        decoding, no arrival that could join, no fork, preemption or swap,
        enough pages) is planned -- scheduling, one slot reserved per
        sequence, metadata uploaded -- and launched before the host reads the
        step in flight's sampled ids: its input ids are those ids, copied
        device to device. Then the host reads them, appends them, checks
        stops and builds outputs while the device computes the new step, and
        launches its sampling. Each :meth:`step` call returns the tokens of
        the step launched by the call before it.

        A sequence that finishes (or is aborted) while the next step is in
        flight keeps its row there: its result is dropped, and its pages,
        the extra slot included, are freed once that step's ids have been
        read. Any other step runs synchronously after the step in flight is
        drained (read and applied). Async steps reserve slots without token
        ids, so pages filled by generated tokens in async steps are not
        registered in the prefix cache (prompt pages are, as ever): a
        sequence's page hash chain needs every id of the page when the page
        fills, and the id of an async step's token is still on the device
        then. Off by default. Turning it on where it cannot run (a runner
        without device input ids, i.e. tensor parallelism, or a cache with a
        host tier) raises EngineError and changes nothing (see
        :func:`async_scheduling_error`). Greedy and seeded sampling give the
        same tokens either way.
        """
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if on:
            err = async_scheduling_error(type(self.runner), getattr(self.cache, "host_tier", None) is not None)
            if err is not None:
                raise err
        elif self._inflight is not None:
            self._drain(self._late)  # its tokens are applied; the next step() reports them
        self._async = bool(on)

    def _continue(self, prev: "_InFlight", rows: list[int], nxt: Any, changed: dict[str, Request]) -> None:
        """Launch ``nxt`` (planned by schedule_continuation) on ``prev``'s sampled ids, then apply ``prev``.

        ``rows``: the indices in ``prev.seqs`` of ``nxt``'s sequences (prev's rows still running, in order).
        """
        ids = prev.sample.tokens
        if len(rows) != len(prev.seqs):
            ids = ids.index_select(0, to_device(rows, torch.long, ids.device))
        self.num_steps += 1
        self.num_async_steps += 1
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        logits = self.runner.run(nxt.step, ids, [s.num_computed for s in nxt.seqs], list(range(len(nxt.seqs))))
        self._count_decode(nxt.step)
        for seq in nxt.seqs:
            seq.num_computed += 1
        cur = self._inflight = _InFlight(nxt.seqs, None)  # finishing from here on: freed after nxt's sync
        self._apply(prev.seqs, prev.sample.result(), changed)
        self._free(prev.zombies)
        # drawn after applying prev: history (penalties) and min_tokens see its tokens; finished rows draw too
        slots, _, _ = self._slots(nxt)
        cur.sample = sample_async(logits, slots)
        if not any(s.status is Status.RUNNING for s in cur.seqs):
            self._drain(changed)  # everything finished: nobody would call step() for it

    def _count_decode(self, step: Any) -> None:
        if step.is_decode:
            self.num_decode_steps += 1
            self.num_decode_tokens += step.batch

    def _drain(self, changed: dict[str, Request]) -> None:
        """Read and apply the step in flight, then free the sequences that finished during it."""
        cur, self._inflight = self._inflight, None
        self._apply(cur.seqs, cur.sample.result(), changed)
        self._free(cur.zombies)

    def _free(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.cache.free(seq.seq_id)

    def _remove(self, seq: Sequence) -> None:
        """Take a finishing sequence out of the scheduler; a row of the step in flight keeps its pages till it ran."""
        cur = self._inflight
        if cur is not None and seq.status is Status.RUNNING and seq in cur.rows:
            self.scheduler.remove(seq, free=False)
            cur.zombies.append(seq)
        else:
            self.scheduler.remove(seq)

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        p = seq.request.params
        if seq.num_output >= p.min_tokens:
            return ()
        return tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)))

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.request.params
        num_out = seq.num_output
        if num_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
        if p.stop and num_out >= p.min_tokens:
            text = self._running_text(seq)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                seq.completion.text = text[:at]
                return self._finish(seq, "stop", s, text_done=True)
        if p.max_tokens is not None and num_out >= p.max_tokens:
            return self._finish(seq, "length", None)
        if len(seq.tokens) >= self.max_model_len:
            return self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: Any, text_done: bool = False) -> None:
        self._remove(seq)
        seq.completion.finish_reason = reason
        seq.completion.stop_reason = stop_reason
        if not text_done:
            seq.completion.text = self._text(seq)
        req = seq.request
        if req.refresh_finished():
            req.metrics.finished_time = time.perf_counter()

def async_scheduling_error(runner_type: type, host_tier: bool) -> EngineError | None:
    """The error for turning async scheduling on with a ``runner_type`` runner (and a host tier), or None if it runs.

    Asked for explicitly, an unsupported async scheduling is refused, not
    quietly run synchronously (vLLM's ``async_scheduling=True`` fails the
    same way): the engine's setter raises this, and
    :func:`~.loader.build_engine` raises it before it loads anything. A
    runner must take the token ids as a device tensor
    (``device_input_ids``): tensor-parallel ranks get them from the host.
    """
    if not getattr(runner_type, "device_input_ids", False):
        return EngineError(f"async_scheduling needs a runner that takes token ids on the device; "
                           f"{runner_type.__name__} takes them from the host (tensor-parallel ranks do): "
                           f"use tp=1, or leave async_scheduling off")
    if host_tier:
        return EngineError("async_scheduling does not run with a host tier (host_tokens); "
                           "leave one of them off")
    return None


class _InFlight:
    """A launched decode step whose sampled ids the host has not read yet (async scheduling).

    ``seqs``: its rows, in order; ``sample``: its draws (None while being
    launched); ``zombies``: rows that finished or were aborted after it was
    launched, freed once its ids are read (its kernels still use their pages).
    """

    __slots__ = ("seqs", "rows", "sample", "zombies")

    def __init__(self, seqs: list[Sequence], sample: PendingSample | None) -> None:
        self.seqs = seqs
        self.rows = set(seqs)
        self.sample = sample
        self.zombies: list[Sequence] = []


_NONE: list[int] = []  # shared empty history (the sampler only reads it)


def _uses_history(p: SamplingParams) -> bool:
    """Whether sampling reads the completion's tokens so far (penalties); else the sampler gets none."""
    return p.repetition_penalty != 1 or bool(p.presence_penalty) or bool(p.frequency_penalty)
