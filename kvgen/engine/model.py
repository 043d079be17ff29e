"""The Llama-family decoder in plain torch; attention goes through a callable (the kvgen runtime).

Parameters are named as in Hugging Face checkpoints (``model.layers.3.
self_attn.q_proj.weight``...), so loading is a name-for-name copy into
preallocated tensors. q/k/v/o and gate/up/down are separate ``[out, in]``
parameters with head-major rows: a later tensor-parallel split cuts q/k/v
and gate/up by rows (column-parallel) and o/down by columns (row-parallel).
q/k/v (and gate/up) are row views of one fused matrix per layer, so a step
runs one GEMM for them (at batch 1 every kernel launch counts).

The elementwise work between the GEMMs runs as four fused kernels per
layer (:mod:`.fused`): residual add + RMSNorm twice, q/k/v split + q/k
norm + RoPE into contiguous q, k, v (what the cache write and attention
read, so no copies), and SiLU(gate) * up. The projections go through
:func:`.gemv.linear`: ``nn.functional.linear``, or for the rows of a
small decode batch (up to 64) kvgen's GEMV or small GEMM where the decode
graphs found it faster; where the small GEMM runs gate/up, SiLU * up is
its epilogue (:func:`.gemv.gated_linear`) and no kernel of its own, and
where it runs q/k/v (no q/k norms), so is RoPE (:func:`.gemv.qkv_rope_linear`).
With :data:`.gemv.FUSED_NORM` on (off by default: measured slower), where
it runs o and down the residual add is their epilogue
(:func:`.gemv.residual_linear`) and the RMSNorm after it the next
projection's prologue (:class:`.gemv.DeferredNorm`; the norm kernel where
that projection runs elsewhere): no norm kernel between two small GEMMs.

``forward(input_ids, positions, attend)`` runs every layer over the step's
flat tokens; ``attend(layer, q, k, v)`` (``q [T, Hq, D]``, ``k``/``v``
``[T, Hkv, D]``, after RoPE) returns ``[T, Hq, D]``. The engine passes the
runtime's prefill or decode op there, or, inside a CUDA graph, the kernels
on static buffers. An ``attend`` with a ``kv_write(layer)`` attribute (the
graphs') names the layer's cache pages and slots
(:class:`.kv_write.KVWrite`): where the kernel applying RoPE (the q/k/v
small GEMM's epilogue or the RoPE kernel) stores k and v there itself,
``attend`` gets None for both.

Tensor parallelism (``shard=`` a :class:`~kvgen.engine.shard.TPShard`):
the layers hold the rank's rows of q/k/v and gate/up and its columns of o
and down (same checkpoint names, smaller shapes); o and down sum their
partial outputs over the ranks with ``torch.distributed.all_reduce``
(capturable in a CUDA graph with NCCL). Without a shard nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from . import fused, gemv, small_gemm
from .config import ModelConfig
from .rope import Rotary
from .shard import TPShard

Attend = Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an uninitialized ``[out, in]`` weight (filled by the loader).

    ``weight``/``bias`` given: the parameters are those tensors (views into a
    fused matrix: loading into them fills the fused one).
    """

    def __init__(self, n_in: int, n_out: int, bias: bool, weight: torch.Tensor | None = None,
                 bias_view: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _param(n_out, n_in) if weight is None else nn.Parameter(weight, requires_grad=False)
        if bias:
            self.bias = _param(n_out) if bias_view is None else nn.Parameter(bias_view, requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: gemv.Input) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(residual + y, stats)`` with ``y = self(x)`` added in place by one kernel where the small GEMM runs
        this projection (:func:`.gemv.residual_linear`), else ``(y, None)``: the caller adds."""
        fused_add = gemv.residual_linear(x, self.weight, self.bias, residual)
        return fused_add if fused_add is not None else (self(x), None)


class RowParallelLinear(Linear):
    """A Linear holding its input columns of this rank: ``y = all_reduce(x W_r^T) + b`` (bias whole, added once)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, shard: TPShard) -> None:
        super().__init__(n_in, n_out, bias)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gemv.linear(x, self.weight)
        dist.all_reduce(y, group=self.shard.group)  # the group is set after the model is built
        return y if self.bias is None else y + self.bias

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(self(x), None)``: the sum over ranks comes before any residual add."""
        return self(x), None


def _out_linear(n_in: int, n_out: int, bias: bool, shard: TPShard | None) -> Linear:
    return Linear(n_in, n_out, bias) if shard is None else RowParallelLinear(n_in, n_out, bias, shard)


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: normalize in float32, cast back, then scale."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(n)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x``, then ``(norm(residual), residual)`` in one kernel (see :func:`fused.add_rms_norm`)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)

    def enter(self, h: torch.Tensor, residual: torch.Tensor | None,
              stats: torch.Tensor | None) -> tuple[gemv.Input, torch.Tensor]:
        """A pre-norm block's input ``(norm(residual + h), residual + h)`` (the residual updated in place).

        ``stats`` given: the previous block's projection already added its output into ``residual`` (``h`` is
        that residual) and left these sums of squares (:func:`.gemv.residual_linear`); the norm is deferred to
        the next projection (:class:`.gemv.DeferredNorm`). Otherwise :meth:`add_forward`."""
        if stats is not None:
            return gemv.DeferredNorm(h, small_gemm.Norm(stats, self.weight, self.eps)), h
        return self.add_forward(h, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        H, nq, nkv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        if shard is not None:  # this rank's heads only
            nq, nkv = len(shard.q_heads) * cfg.head_dim, len(shard.kv_heads) * cfg.head_dim
        # One [q+k+v, H] matrix (one GEMM per layer); q/k/v_proj are row views of it, named as in checkpoints.
        self.register_buffer("qkv_weight", torch.empty(nq + 2 * nkv, H), persistent=False)
        self.register_buffer("qkv_bias", torch.empty(nq + 2 * nkv) if cfg.qkv_bias else None, persistent=False)
        w, b = self.qkv_weight, self.qkv_bias
        rows = {"q": (0, nq), "k": (nq, nkv), "v": (nq + nkv, nkv)}
        for name, (start, n) in rows.items():
            setattr(self, f"{name}_proj", Linear(H, n, cfg.qkv_bias, w.narrow(0, start, n),
                                                 None if b is None else b.narrow(0, start, n)))
        self.sizes = (nq, nkv, nkv)
        self.o_proj = _out_linear(nq, H, cfg.o_bias, shard)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, layer: int, x: gemv.Input, positions: torch.Tensor, rotary: Rotary, attend: Attend,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The o projection's output and None, or, added into ``residual`` by it, ``(residual, stats)``
        (:meth:`Linear.forward_residual`)."""
        T, D = positions.shape[0], self.cfg.head_dim
        heads = (self.sizes[0] // D, self.sizes[1] // D, D)
        # where attend names the cache pages (the decode graphs), k and v may go there directly (None back)
        target = getattr(attend, "kv_write", None)
        write = None if target is None else target(layer)
        if self.cfg.qk_norm:
            qkv = gemv.linear(x, self.qkv_weight, self.qkv_bias)
            # one kernel: contiguous q, k, v (no copies before the cache write), q/k norms, RoPE
            q, k, v = fused.qkv_rope(qkv, positions, rotary.cos, rotary.sin, *heads, self.q_norm.weight,
                                     self.k_norm.weight, eps=self.cfg.rms_norm_eps, write=write)
        else:  # the same, or the projection's epilogue where the small GEMM runs it (gemv.qkv_rope_linear)
            q, k, v = gemv.qkv_rope_linear(x, self.qkv_weight, self.qkv_bias, positions, rotary.cos, rotary.sin,
                                           *heads, write=write)
        out = attend(layer, q, k, v)
        return self.o_proj.forward_residual(out.reshape(T, -1).to(self.qkv_weight.dtype), residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size if shard is None else len(shard.inter)
        # gate and up as row views of one [2I, H] matrix: one GEMM per layer.
        self.register_buffer("gate_up_weight", torch.empty(2 * I, H), persistent=False)
        self.register_buffer("gate_up_bias", torch.empty(2 * I) if cfg.mlp_bias else None, persistent=False)
        w, b = self.gate_up_weight, self.gate_up_bias
        self.gate_proj = Linear(H, I, cfg.mlp_bias, w.narrow(0, 0, I), None if b is None else b.narrow(0, 0, I))
        self.up_proj = Linear(H, I, cfg.mlp_bias, w.narrow(0, I, I), None if b is None else b.narrow(0, I, I))
        self.down_proj = _out_linear(I, H, cfg.mlp_bias, shard)
        self.inter = I

    def forward(self, x: gemv.Input, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`Attention.forward`: down's output and None, or ``(residual, stats)``."""
        return self.down_proj.forward_residual(gemv.gated_linear(x, self.gate_up_weight, self.gate_up_bias),
                                               residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size,
                                                                                              cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder plus LM head (``shard``: one rank's share). Built by ``weights.build_model``."""

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.shard = shard
        self.model = _Body(cfg, shard)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.rotary: Rotary | None = None

    def setup_rotary(self) -> None:
        """Build the cos/sin tables on the parameters' device (after they are placed)."""
        self.rotary = Rotary(self.cfg, self.max_positions, self.model.norm.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the last layer (before the final norm).

        Each norm also adds the previous block's output into the residual
        stream (one kernel), or that block's last projection did
        (:meth:`RMSNorm.enter`); the last block's output is added at the end.
        """
        h = self.model.embed_tokens(input_ids)
        residual = stats = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer.input_layernorm.enter(h, residual, stats)
            h, stats = layer.self_attn(i, x, positions, self.rotary, attend, residual)
            x, residual = layer.post_attention_layernorm.enter(h, residual, stats)
            h, stats = layer.mlp(x, residual)
        return residual if stats is not None else h + residual

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits ``[N, vocab]`` of hidden rows ``[N, hidden]``: float32, or (``float32=False``) in the model's
        dtype as the LM head computes them, which the sampler widens only where it needs to
        (:mod:`.sampler`)."""
        h = self.model.norm(hidden)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        out = gemv.linear(h, w)
        return out.float() if float32 else out
