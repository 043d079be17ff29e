"""Streaming quality metrics of one scheme against the float32-cache baseline.

Per scored position ``t`` (the model's prediction of token ``t + 1``):

- NLL of the true next token, for perplexity ``exp(mean NLL)``;
- KL divergence ``KL(P_base || P_scheme) = sum_v p_base(v) (log p_base(v) - log p_scheme(v))``
  in nats, of the next-token distributions;
- top-1 agreement: the scheme's argmax equals the baseline's.

Sums are kept separately for predictions made by the prefill forward and by
one-token decode steps, in float64, so the totals do not depend on how the
windows were cut into chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

CHUNK = 256
"""Positions per log-softmax chunk: bounds memory at ``CHUNK x vocab`` floats a tensor."""


@dataclass
class Sums:
    tokens: int = 0
    nll: float = 0.0
    base_nll: float = 0.0
    kl: float = 0.0
    top1: int = 0

    def add(self, other: "Sums") -> None:
        self.tokens += other.tokens
        self.nll += other.nll
        self.base_nll += other.base_nll
        self.kl += other.kl
        self.top1 += other.top1

    def summary(self) -> dict[str, float]:
        if not self.tokens:
            return {"ppl": math.nan, "base_ppl": math.nan, "delta_ppl": math.nan, "rel_delta_ppl": math.nan,
                    "kl": math.nan, "top1": math.nan}
        ppl = math.exp(self.nll / self.tokens)
        base = math.exp(self.base_nll / self.tokens)
        return {"ppl": ppl, "base_ppl": base, "delta_ppl": ppl - base, "rel_delta_ppl": (ppl - base) / base,
                "kl": self.kl / self.tokens, "top1": self.top1 / self.tokens}


@dataclass
class SchemeScore:
    """Accumulated metrics of one scheme: prefill-forward and decode-step predictions."""

    prefill: Sums = field(default_factory=Sums)
    decode: Sums = field(default_factory=Sums)

    def total(self) -> Sums:
        s = Sums()
        s.add(self.prefill)
        s.add(self.decode)
        return s


@torch.no_grad()
def score(base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> Sums:
    """Metrics of ``logits`` against ``base_logits`` (both ``[T, V]``) for the true ``targets`` ``[T]``."""
    out = Sums()
    targets = targets.to(logits.device)
    for i in range(0, logits.shape[0], CHUNK):
        lb = torch.log_softmax(base_logits[i:i + CHUNK].float(), -1)
        lq = torch.log_softmax(logits[i:i + CHUNK].float(), -1)
        t = targets[i:i + CHUNK, None]
        out.tokens += t.shape[0]
        out.nll -= lq.gather(-1, t).double().sum().item()
        out.base_nll -= lb.gather(-1, t).double().sum().item()
        # KL per position in float32, summed in float64; clamp tiny negative rounding of identical rows.
        kl = (lb.exp() * (lb - lq)).sum(-1).clamp_min(0.0)
        out.kl += kl.double().sum().item()
        out.top1 += (lq.argmax(-1) == lb.argmax(-1)).sum().item()
    return out
