"""Continuous batching over a KVCache: who runs this step and with how many tokens (no torch).

Every step (vLLM v1 style, FIFO):

1. Running sequences, oldest first, take ``min(tokens left to compute,
   budget)`` tokens each: 1 for a decoding sequence, a chunk of a prompt
   otherwise, until ``max_num_batched_tokens`` is spent.
2. Waiting sequences join while the budget and ``max_num_seqs`` allow
   (a request that will fork into ``n`` completions counts ``n``). Joining
   is ``cache.add(seq_id, tokens[:-1])``: the prefix cache returns how many
   leading tokens are already stored, and only the rest is fed.
3. ``cache.plan_step`` reserves every slot at once. ``OutOfPages`` changes
   nothing; the scheduler then sends back the sequences it just admitted,
   newest first, and after them preempts the newest running sequence
   (recompute: free its pages, put it at the front of the queue with its
   generated tokens) and tries again.

The cache holds exactly the running sequences; finishing or aborting one
frees it.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

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
    queue while planning this step.
    """

    seqs: list[Sequence]
    num_new: list[int]
    step: Any
    sample: list[bool]
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """FIFO continuous batching with chunked prefill, prefix reuse and preemption by recompute."""

    def __init__(self, cache: Any, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self._out_of_pages = out_of_pages_types(cache)
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.truncated: list[Sequence] = []
        """Lone sequences the cache could not hold any more, removed; the engine finishes them (``length``)."""

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

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished or aborted), freeing its pages if it holds any."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
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

    def _send_back(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledStep | None:
        """Plan the next step (None when nothing is waiting or running)."""
        preempted: list[Sequence] = []
        admit_limit = None
        while True:
            if not self.running and not self.waiting:
                return None
            budget = self.max_num_batched_tokens
            seqs: list[Sequence] = []
            counts: list[int] = []
            for seq in self.running:
                if budget <= 0:
                    break
                n = min(len(seq.tokens) - seq.num_computed, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
            admitted: list[Sequence] = []
            slots = self._slots()
            while (self.waiting and budget > 0 and (admit_limit is None or len(admitted) < admit_limit)
                   and slots + self.waiting[0].reserve <= self.max_num_seqs):
                seq = self.waiting.popleft()
                self._admit(seq)
                slots += seq.reserve
                n = min(len(seq.tokens) - seq.num_computed, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                admitted.append(seq)
            if not seqs:
                return None
            try:
                toks = [s.tokens[s.num_computed:s.num_computed + n] for s, n in zip(seqs, counts)]
                step = self.cache.plan_step([s.seq_id for s in seqs], counts, token_ids=toks)
            except self._out_of_pages:
                if admitted and len(self.running) == len(admitted) == 1:
                    self.remove(admitted[0])  # alone and still too big: finish it rather than loop forever
                    self.truncated.append(admitted[0])
                elif admitted:
                    admit_limit = len(admitted) - 1
                    for seq in reversed(admitted):
                        self._send_back(seq)
                elif len(self.running) > 1:
                    victim = self.running[-1]
                    self._send_back(victim)
                    preempted.append(victim)
                    self.num_preemptions += 1
                else:
                    victim = self.running[0]
                    self.remove(victim)
                    self.truncated.append(victim)
                continue
            sample = [s.num_computed + n == len(s.tokens) for s, n in zip(seqs, counts)]
            return ScheduledStep(seqs, counts, step, sample, preempted)
