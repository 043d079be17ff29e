"""Turn logits into tokens per SamplingParams: penalties, temperature, top-k/top-p/min-p, seeded draws.

Draws use the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which
picks token ``i`` with probability ``p_i``: one batched draw for unseeded
rows, each seeded row from its own ``torch.Generator`` (so its tokens do not
depend on what it is batched with). Greedy rows take the argmax of the
penalized logits. Log-probabilities are of the raw model distribution.

Logits may come in float32 or in the model's 16-bit dtype: a row's argmax
is the same in either (the widening is exact), so a greedy batch without
penalties or log-probabilities takes it from the 16-bit logits as they
are, and everything else computes on their float32 widening, the values
the float32 logits would have had (a ``[N, V]`` conversion pass fewer per
greedy step: 24 MB of traffic at Llama-3's vocabulary and 32 rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .sampling_params import SamplingParams
from .upload import to_device


@dataclass
class SampleSlot:
    """One token to draw: from logits row ``row`` with ``params``; ``history`` = (prompt ids, output ids)."""

    row: int
    params: SamplingParams
    generator: Any
    prompt_ids: list[int]
    output_ids: list[int]
    banned: tuple[int, ...] = ()  # ids masked out (EOS/stop ids before min_tokens)


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _penalize(x: torch.Tensor, slot: SampleSlot) -> None:
    p = slot.params
    dev = x.device
    if p.repetition_penalty != 1:
        seen = to_device(sorted(set(slot.prompt_ids) | set(slot.output_ids)), torch.long, dev)
        if seen.numel():
            v = x.index_select(0, seen)
            x.index_copy_(0, seen, torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty))
    if (p.presence_penalty or p.frequency_penalty) and slot.output_ids:
        # index_add_, not bincount: bincount reads its maximum back to the host (a device sync per row)
        ids = to_device(slot.output_ids, torch.long, dev)
        counts = torch.zeros_like(x).index_add_(0, ids, torch.ones(ids.numel(), dtype=x.dtype, device=dev))
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def filter_logits(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities ``[S, V]`` after temperature, top-k, top-p and min-p (per-row settings, off = no-op)."""
    x = x / temperature[:, None]
    V = x.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    srt, idx = x.sort(dim=1, descending=True)
    kth = srt.gather(1, (k - 1)[:, None])
    drop = srt < kth
    probs = torch.softmax(srt.masked_fill(drop, float("-inf")), dim=1)
    cum = probs.cumsum(1)
    drop |= (cum - probs) > top_p[:, None]  # keep the smallest head whose mass reaches top_p (at least one)
    probs = probs.masked_fill(drop, 0.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, idx, probs)


class PendingSample:
    """Tokens drawn on the device that the host has not read yet.

    ``tokens``: int64 ``[S]`` on the logits' device, one per slot in slot
    order (async scheduling feeds it to the next step without a host round
    trip). :meth:`result` reads them (the step's one host sync) and builds
    the :class:`Sampled` list; call it once.
    """

    def __init__(self, tokens: torch.Tensor, want: list[int | None], logprobs: tuple | None) -> None:
        self.tokens = tokens
        self._want = want
        # On a GPU the draws start down to pinned host memory now, behind an event: result() then waits
        # for this step's draws only. A plain .tolist() there would be queued behind whatever the host
        # launched since (async scheduling launches the next step first) and wait for that too.
        self._host = [tokens, *(logprobs or ())]
        self._ready = None
        if tokens.is_cuda:
            self._host = [_to_pinned(t) for t in self._host]
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tokens.device))
        self._logprobs = logprobs is not None

    def result(self) -> list[Sampled]:
        if self._ready is not None:
            self._ready.synchronize()  # the step's one host sync
        if not self._logprobs:
            return [Sampled(t) for t in self._host[0].tolist()]
        tokens_h, chosen_h, top_v, top_i = (t.tolist() for t in self._host)
        out = []
        for i, w in enumerate(self._want):
            if w is None:
                out.append(Sampled(tokens_h[i]))
                continue
            top = {top_i[i][j]: top_v[i][j] for j in range(w)}
            top[tokens_h[i]] = chosen_h[i]
            out.append(Sampled(tokens_h[i], chosen_h[i], top))
        return out


ARGMAX_CHUNK = 512
"""Where the search for a row's argmax chunk width starts (:func:`_argmax_chunk`); rows wider than four of it
take two passes."""


@functools.lru_cache(maxsize=64)
def _argmax_chunk(v: int) -> int:
    """A chunk width for rows of ``v`` entries: the first divisor of ``v`` from :data:`ARGMAX_CHUNK` up to four
    times it, else the first one below it down to half (the row splits into chunks as a view), else
    :data:`ARGMAX_CHUNK` (the row is padded). Cached: it is looked up at every sampling step."""
    for c in range(ARGMAX_CHUNK, 4 * ARGMAX_CHUNK + 1):
        if v % c == 0:
            return c
    for c in range(ARGMAX_CHUNK - 1, ARGMAX_CHUNK // 2 - 1, -1):
        if v % c == 0:
            return c
    return ARGMAX_CHUNK


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` of a 2-D tensor, the same indices (the first maximal entry, NaN counting as maximal).

    Wide rows take two passes: each chunk of :func:`_argmax_chunk` entries to its maximum and index, then the
    best chunk. torch's one pass over a single 128K-entry row is latency-bound on a GPU; the two passes are a
    few small kernels (measured in benchmarks/results/2026-12-03-nvidia-h200/README.md).
    """
    n, v = x.shape
    if v <= 4 * ARGMAX_CHUNK or n == 0:
        return x.argmax(dim=1)
    c = _argmax_chunk(v)
    # the padding (-inf) follows the row's last entry: it can tie the last chunk's maximum only where that is
    # -inf too, and ties go to the first index, a real entry
    xp = torch.nn.functional.pad(x, (0, -v % c), value=float("-inf")) if v % c else x
    vals, idx = xp.reshape(n, -1, c).max(dim=2)
    best = vals.argmax(dim=1)
    return best * c + idx.gather(1, best[:, None])[:, 0]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``t``, started on the current stream (valid once it has run)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def sample(logits: torch.Tensor, slots: list[SampleSlot]) -> list[Sampled]:
    """One token per slot from ``logits [N, V]`` (float32, or the model's dtype: the module docstring); one host
    sync for the whole batch."""
    return sample_async(logits, slots).result()


def sample_async(logits: torch.Tensor, slots: list[SampleSlot]) -> PendingSample:
    """:func:`sample` without the host sync: the draws are launched, :meth:`PendingSample.result` reads them."""
    dev = logits.device
    rows = [s.row for s in slots]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        raw = logits  # one slot per row, in order (every decode step without forks): nothing to gather
    else:
        raw = logits.index_select(0, to_device(rows, torch.long, dev))
    wide = raw if raw.dtype == torch.float32 else None

    def widened() -> torch.Tensor:
        """raw as float32, converted at most once (the penalties copy it; filtering and log-probs read it)."""
        nonlocal wide
        if wide is None:
            wide = raw.float()
        return wide

    x = raw
    if any(s.params.penalized or s.banned for s in slots):
        x = widened().clone()
        for i, s in enumerate(slots):
            if s.params.penalized:
                _penalize(x[i], s)
            if s.banned:
                x[i].index_fill_(0, to_device(list(s.banned), torch.long, dev), float("-inf"))
    greedy = [s.params.greedy for s in slots]
    tokens = row_argmax(x)
    if not all(greedy):
        # one upload for the per-row settings (top_k as float: exact for any vocabulary index)
        rows_h = to_device([[s.params.temperature or 1.0, s.params.top_k, s.params.top_p, s.params.min_p,
                             float(s.params.greedy)] for s in slots], torch.float32, dev)
        temp, top_k, top_p, min_p, greedy_d = rows_h.unbind(1)
        probs = filter_logits(x if x.dtype == torch.float32 else widened(), temp, top_k.long(), top_p, min_p)
        q = torch.empty_like(probs).exponential_()
        for i, s in enumerate(slots):
            if s.generator is not None:
                q[i].exponential_(generator=s.generator)
        drawn = row_argmax(probs / q)
        tokens = torch.where(greedy_d.bool(), tokens, drawn)
    want = [s.params.logprobs for s in slots]
    if all(w is None for w in want):
        return PendingSample(tokens, want, None)
    logp = torch.log_softmax(widened(), dim=1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    n = max(w or 0 for w in want)
    top_v, top_i = logp.topk(max(n, 1), dim=1)
    return PendingSample(tokens, want, (chosen, top_v, top_i))
