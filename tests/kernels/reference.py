"""The float64 attention every kernel test compares against, and the relative L2 error it is judged by.

Contract: ``reference_attention`` is plain attention (causal by position, optional sliding window and softcap,
GQA by head index) in float64 on the CPU or, for large cases, on the query's CUDA device; it never reads a
kernel, a page layout or a scheme. ``tests/kernels/harness.py`` re-exports both names.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


def _positions(q_positions: Any, batch: int) -> list[torch.Tensor]:
    if isinstance(q_positions, torch.Tensor) and q_positions.dim() == 1 and q_positions.numel() == batch:
        return [q_positions[b : b + 1].long().cpu() for b in range(batch)]
    out = []
    for p in q_positions:
        if isinstance(p, int) or (isinstance(p, torch.Tensor) and p.dim() == 0):
            out.append(torch.tensor([int(p)]))
        else:
            out.append(torch.as_tensor(p).long().cpu().flatten())
    return out


def reference_attention(q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                        q_positions: Any, window: int = 0, softcap: float = 0.0,
                        sm_scale: float | None = None) -> torch.Tensor:
    """Float64 attention of queries over per-sequence K/V, causal by position.

    ``q``: ``[total_q, Hq, D]``, sequence ``b``'s queries consecutive (decode:
    ``[B, Hq, D]``). ``ks[b]``/``vs[b]``: ``[H, n_b, D]``, key ``j`` at position
    ``j``. ``q_positions``: per sequence, the positions of its queries (a list of
    lists/tensors), or one position per sequence (a ``[B]`` tensor or list of
    ints, decode). A query at ``p`` sees keys ``j <= p`` (and ``j > p - window``
    when ``window > 0``); ``softcap > 0`` caps logits ``softcap*tanh(x/softcap)``.
    Query head ``h`` uses KV head ``h // (Hq // H)``. A query that sees no key
    gets zeros. Returns float64 ``[total_q, Hq, D]`` on the CPU.

    The arithmetic runs where ``q`` lives: float64 on a CUDA device takes a
    real-size (4096 x 4096 tokens, 64 heads) reference from minutes of CPU
    time to a fraction of a second.
    """
    B = len(ks)
    pos = _positions(q_positions, B)
    work = q.device if q.device.type == "cuda" else torch.device("cpu")
    q = q.detach().to(work, torch.float64)
    Hq, D = q.shape[1], q.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q)
    row = 0
    for b in range(B):
        k = ks[b].detach().to(work, torch.float64)
        v = vs[b].detach().to(work, torch.float64)
        H, n = k.shape[0], k.shape[1]
        group = Hq // H
        p = pos[b].to(work)
        nq = p.numel()
        qb = q[row : row + nq]  # [nq, Hq, D]
        row += nq
        if n == 0:
            continue
        kk = k.repeat_interleave(group, dim=0)  # [Hq, n, D]
        vv = v.repeat_interleave(group, dim=0)
        logits = torch.einsum("qhd,hnd->hqn", qb, kk) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        j = torch.arange(n, device=work)
        visible = j[None, :] <= p[:, None]
        if window > 0:
            visible &= j[None, :] > (p[:, None] - window)
        logits = logits.masked_fill(~visible[None], float("-inf"))
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w = torch.exp(logits - m)
        den = w.sum(-1, keepdim=True)
        o = torch.einsum("hqn,hnd->qhd", w / torch.where(den > 0, den, torch.ones_like(den)), vv)
        out[row - nq : row] = o
    return out.cpu()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (NaN anywhere gives NaN, i.e. a failure)."""
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    den = b.norm().item()
    return (a - b).norm().item() / max(den, 1e-30)
