"""Continuous batching over a KVCache: who runs this step and with how many tokens (no torch).

Every step (vLLM v1 style, FIFO):

1. Running sequences, oldest first, take their tokens left to compute, up
   to what is left of the budget (:func:`chunk_tokens`): 1 for a decoding
   sequence, a chunk of a prompt otherwise, until
   ``max_num_batched_tokens`` is spent. A prompt whose last chunk would
   be short gets two near-equal last chunks instead.
2. Waiting sequences join while the budget and ``max_num_seqs`` allow
   (a request that will fork into ``n`` completions counts ``n``). Joining
   is ``cache.add(seq_id, tokens[:-1])``: the prefix cache returns how many
   leading tokens are already stored, and only the rest is fed.
3. ``cache.plan_step`` reserves every slot at once. ``OutOfPages`` changes
   nothing; the scheduler then sends back the sequences it just admitted,
   newest first, and after them preempts the newest running sequence and
   tries again.

Preemption (``preemption_mode``):

- ``"recompute"``: free the victim's pages and put it at the front of the
  queue with its generated tokens; it is fed again when readmitted (the
  prefix cache may still hold a part).
- ``"swap"`` (the default when the cache has a host tier): ``cache.swap_out``
  moves the victim's pages to the host tier; it keeps its computed tokens,
  waits at the front of the queue as ``SWAPPED``, and is readmitted by
  ``cache.swap_in`` (left waiting while the device lacks pages). The
  victim's whole fork group (the running completions of its request) goes
  in one call, so pages they share are copied once and shared again after
  the swap-in -- unless that group is everything running, then the victim
  alone (the runtime copies shared pages per call: correct, more memory).
  When the host tier is full, the victim is recomputed instead.

The cache holds the running and the swapped sequences; finishing or aborting
one frees it (a swapped one's host pages too). A swapped sequence is never
named in a step.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .errors import EngineError
from .sequence import Sequence, Status


def out_of_pages_types(cache: Any) -> tuple[type, ...]:
    """The OutOfPages classes ``cache`` may raise: kvgen.runtime's, and its generated package's own copy.

    A generated package ships a verbatim copy of the runtime, so its errors
    are distinct classes from ``kvgen.runtime.errors``'. A wrapper of the
    cache (tensor parallelism's recorder) names it as ``__wrapped__``.
    """
    from kvgen.runtime.errors import OutOfPages  # torch-free module

    cache = getattr(cache, "__wrapped__", cache)

    found = [OutOfPages]
    errors = sys.modules.get(type(cache).__module__.rpartition(".")[0] + ".errors")
    if errors is not None and isinstance(getattr(errors, "OutOfPages", None), type):
        found.append(errors.OutOfPages)
    return tuple(found)


@dataclass
class ScheduledStep:
    """One step's batch: ``seqs[i]`` feeds ``num_new[i]`` tokens; ``step`` is the runtime's StepMetadata.

    ``sample[i]``: the step reaches the end of ``seqs[i]``'s tokens, so its
    last row gives the next token. ``preempted``: sequences sent back to the
    queue while planning this step. ``swapped``: a swap between the tiers
    happened while planning it (the runner then runs the step eagerly).
    """

    seqs: list[Sequence]
    num_new: list[int]
    step: Any
    sample: list[bool]
    preempted: list[Sequence] = field(default_factory=list)
    swapped: bool = False


PREEMPTION_MODES = ("swap", "recompute")


SHORT_CHUNK_FRACTION = 8
"""A prompt's last chunk shorter than the budget over this is merged into an even cut of the last two
(:func:`chunk_tokens`)."""


def chunk_tokens(left: int, budget: int) -> int:
    """The tokens a sequence with ``left`` tokens to compute feeds in a step with ``budget`` tokens to spare.

    All of them when they fit, else the whole budget, except where a full chunk now would leave a last chunk
    shorter than ``budget / SHORT_CHUNK_FRACTION``: then half of what is left, so the last two chunks are
    near-equal (at this step's budget; the next step's may differ). Never more than ``budget``; at least 1
    when ``left`` is. A short last chunk reads the whole prompt through a query block or two (one program a KV head
    each, no split of the keys): on an H200, 44 tokens over a 32K-token int4 prefix took 221 ms, against 35 with
    bf16 KV and 230-460 ms for each 8K-token chunk before it
    (benchmarks/results/2026-12-04-nvidia-h200-4/mixed-step/). Only then: an even cut leaves budget over in two
    steps, and waiting prompts admitted into it compete for pages (a KV-bound engine preempts more).
    """
    if left <= budget:
        return left
    if left - budget < budget // SHORT_CHUNK_FRACTION:
        return -(-left // 2)
    return budget


class Scheduler:
    """FIFO continuous batching with chunked prefill, prefix reuse and preemption by swap or recompute.

    ``preemption_mode``: ``"swap"`` (needs ``cache.host_tier``; the default
    when there is one) or ``"recompute"`` (the default without). Counters:
    ``num_preemptions`` (sequences preempted, either way), ``num_swapped_out``
    / ``num_swapped_in`` (sequences moved by successful swap calls),
    ``num_swap_failures`` (swap-outs the full host tier refused: recomputed).
    """

    def __init__(self, cache: Any, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str | None = None) -> None:
        self._out_of_pages = out_of_pages_types(cache)
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = resolve_preemption_mode(preemption_mode, cache)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_swap_failures = 0
        self.truncated: list[Sequence] = []
        """Lone sequences the cache could not hold any more, removed; the engine finishes them (``length``)."""
        self._swapped_now = False
        # (head of the queue, free device pages) after its admission failed for lack of pages: it is not tried
        # again until pages are freed. Each try costs the cache's add (the whole prompt's ids checked and its
        # prefix hashed) and a failed plan_step, every step while a KV-bound batch runs -- milliseconds of host
        # time per step at 32K-token prompts, and it kept async scheduling off (a head that "could join").
        self._blocked: tuple[Sequence, int] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """``children`` (already forked from ``parent`` in the cache) run right after it."""
        for c in children:
            c.status = Status.RUNNING
        i = self.running.index(parent) + 1
        self.running[i:i] = children

    def remove(self, seq: Sequence, free: bool = True) -> None:
        """Take ``seq`` out (finished or aborted), freeing its pages (device or host) if it holds any.

        ``free=False`` (a running sequence that a launched step still
        computes, see the engine's async scheduling): its device pages stay
        allocated; the caller frees them with ``cache.free`` once that step ran.
        """
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if free:
                self.cache.free(seq.seq_id)
        elif seq.status in (Status.WAITING, Status.SWAPPED) and seq in self.waiting:
            self.waiting.remove(seq)
            if seq.status is Status.SWAPPED:
                self.cache.free(seq.seq_id)
        seq.status = Status.FINISHED

    def _slots(self) -> int:
        return sum(s.reserve for s in self.running)

    def _admit(self, seq: Sequence) -> None:
        cached = self.cache.add(seq.seq_id, seq.tokens[:-1])
        seq.num_computed = cached
        if seq.index == 0 and cached > seq.request.num_cached_tokens:
            seq.request.num_cached_tokens = cached
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _swapped_group(self, seq: Sequence) -> list[Sequence]:
        """The swapped sequences of ``seq``'s request, in queue order (swapped in together, as swapped out)."""
        return [s for s in self.waiting if s.status is Status.SWAPPED and s.request is seq.request]

    def _swap_in(self, group: list[Sequence]) -> bool:
        """Bring ``group`` back to the device and make it running; False (nothing changed) without room."""
        try:
            self.cache.swap_in([s.seq_id for s in group])
        except self._out_of_pages:
            return False
        for s in group:
            self.waiting.remove(s)
            s.status = Status.RUNNING
            self.running.append(s)
        self.num_swapped_in += len(group)
        self._swapped_now = True
        return True

    def _head_unit(self, slots: int) -> list[Sequence] | None:
        """The head of the queue as one unit if it fits beside ``slots`` reserved slots, else None.

        A unit is the head sequence, or the whole swapped fork group it
        belongs to (swapped in together); it fits when its batch slots
        (:attr:`Sequence.reserve`) keep the total within ``max_num_seqs``.
        Both :meth:`schedule` (admission) and :meth:`schedule_continuation`
        (would anything be admitted?) ask this. The queue must not be empty.
        """
        head = self.waiting[0]
        if self._blocked is not None and self._blocked[0] is head and self.running and \
                self.cache.num_free_pages() <= self._blocked[1]:
            return None  # it did not fit, and no page was freed since (the running sequences will free some)
        unit = self._swapped_group(head) if head.status is Status.SWAPPED else [head]
        return unit if slots + sum(s.reserve for s in unit) <= self.max_num_seqs else None

    def _block(self, head: Sequence) -> None:
        """``head`` (the queue's head now) did not fit: leave it until pages are freed."""
        self._blocked = (head, self.cache.num_free_pages())

    def _send_back(self, seq: Sequence) -> None:
        """Recompute: free ``seq``'s pages, queue it at the front with its tokens."""
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, group: list[Sequence]) -> None:
        """Send running ``group`` to the front of the queue: swapped out in one call, else recomputed."""
        if self.preemption_mode == "swap":
            try:
                self.cache.swap_out([s.seq_id for s in group])
            except self._out_of_pages:
                self.num_swap_failures += 1  # the host tier is full: recompute instead
            else:
                for s in reversed(group):
                    self.running.remove(s)
                    s.status = Status.SWAPPED
                    self.waiting.appendleft(s)
                self.num_swapped_out += len(group)
                self._swapped_now = True
                return
        for s in reversed(group):
            self._send_back(s)

    def schedule(self) -> ScheduledStep | None:
        """Plan the next step (None when nothing is waiting or running)."""
        preempted: list[Sequence] = []
        admit_limit = None
        admitted_before_limit = False  # a unit was sent back for lack of pages: block the queue's head after
        self._swapped_now = False
        while True:
            if not self.running and not self.waiting:
                return None
            budget = self.max_num_batched_tokens
            seqs: list[Sequence] = []
            counts: list[int] = []
            for seq in self.running:
                if budget <= 0:
                    break
                n = chunk_tokens(len(seq.tokens) - seq.num_computed, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
            admitted: list[list[Sequence]] = []  # units: one new sequence, or one swapped-in group
            swapped_in: list[bool] = []
            slots = self._slots()
            while self.waiting and budget > 0 and (admit_limit is None or len(admitted) < admit_limit):
                unit = self._head_unit(slots)
                if unit is None:
                    break
                head = unit[0]
                swapped_in.append(head.status is Status.SWAPPED)
                if head.status is Status.SWAPPED:
                    if not self._swap_in(unit):
                        swapped_in.pop()
                        self._block(head)
                        break  # the device lacks pages: it waits (FIFO: nobody overtakes it)
                else:
                    self.waiting.popleft()
                    self._admit(head)
                admitted.append(unit)
                for seq in unit:
                    slots += seq.reserve
                    n = chunk_tokens(len(seq.tokens) - seq.num_computed, budget)
                    if n > 0:
                        seqs.append(seq)
                        counts.append(n)
                        budget -= n
            if not seqs:
                return None
            try:
                toks = [s.tokens[s.num_computed:s.num_computed + n] for s, n in zip(seqs, counts)]
                step = self.cache.plan_step([s.seq_id for s in seqs], counts, token_ids=toks)
            except self._out_of_pages:
                lone = len(admitted) == 1 and len(self.running) == len(admitted[0])
                if lone and len(admitted[0]) == 1:
                    self.remove(admitted[0][0])  # alone and still too big: finish it rather than loop forever
                    self.truncated.append(admitted[0][0])
                elif lone:
                    admit_limit = 0  # a swapped-in fork group alone: keep it; preempt within it next
                elif admitted:
                    admit_limit = len(admitted) - 1
                    admitted_before_limit = True
                    for unit, was_swapped in reversed(list(zip(admitted, swapped_in))):
                        if was_swapped:
                            self._preempt(unit)  # swapped in just now: back to the host (or recompute)
                        else:
                            for seq in reversed(unit):
                                self._send_back(seq)
                elif len(self.running) > 1:
                    victim = self.running[-1]
                    group = [s for s in self.running if s.request is victim.request]
                    if len(group) == len(self.running):
                        group = [victim]  # swapping everything out would leave nothing to run
                    self._preempt(group)
                    preempted.extend(group)
                    self.num_preemptions += len(group)
                else:
                    victim = self.running[0]
                    self.remove(victim)
                    self.truncated.append(victim)
                continue
            if admit_limit is not None and admitted_before_limit and self.waiting:
                self._block(self.waiting[0])  # the unit the limit left out: pages counted after this step's
            sample = [s.num_computed + n == len(s.tokens) for s, n in zip(seqs, counts)]
            return ScheduledStep(seqs, counts, step, sample, preempted, self._swapped_now)


    def schedule_continuation(self, seqs: list[Sequence]) -> ScheduledStep | None:
        """The next decode step of ``seqs`` planned before their last tokens are known (async scheduling).

        ``seqs``: the running sequences of the step in flight, in its row
        order, each with its next token still on the device (``num_computed
        == len(tokens)``). Returns a step feeding one token to each of them,
        with one slot reserved per sequence and no token ids (so pages
        completed by these tokens never enter the prefix cache; see the
        engine's ``async_scheduling``), or None (nothing changed) when the
        step :meth:`schedule` would plan is a different one: the batch is not
        exactly ``self.running`` (preemption, a swap, new forks), a waiting
        request could join now, the token budget is too small for the batch,
        or the pages ran out (the synchronous path then preempts).
        """
        B = len(seqs)
        if not B or B > self.max_num_batched_tokens or len(self.running) != B or \
                any(a is not b for a, b in zip(self.running, seqs)):
            return None
        if self.waiting and B < self.max_num_batched_tokens and self._head_unit(self._slots()) is not None:
            return None  # it would be admitted (or swapped in) now
        ids = []
        for s in seqs:
            if s.num_computed != len(s.tokens):
                return None
            ids.append(s.seq_id)
        try:
            step = self.cache.plan_step(ids, [1] * B)
        except self._out_of_pages:
            return None
        return ScheduledStep(list(seqs), [1] * B, step, [True] * B)


def resolve_preemption_mode(mode: str | None, cache: Any) -> str:
    """``mode``, or the default: ``"swap"`` when ``cache`` has a host tier, else ``"recompute"``."""
    has_tier = getattr(cache, "host_tier", None) is not None
    if mode is None:
        return "swap" if has_tier else "recompute"
    if mode not in PREEMPTION_MODES:
        raise EngineError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")
    if mode == "swap" and not has_tier:
        raise EngineError("preemption_mode='swap' needs a host tier; pass host_tokens=N (or 'plan') too, "
                          "or use preemption_mode='recompute'")
    return mode
