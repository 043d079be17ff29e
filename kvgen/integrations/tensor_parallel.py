"""Tensor parallelism for Llama-architecture Hugging Face models, Megatron style.

``shard_model(model, rank, world_size)`` cuts one rank's share out of a full
model in place:

- column-parallel (output rows split): ``q_proj`` by query heads, ``k_proj``
  and ``v_proj`` by KV heads (replicated when ``world_size`` exceeds the KV
  heads, exactly as the planner's TP shard says), ``gate_proj``/``up_proj``
  by intermediate channels;
- row-parallel (input columns split): ``o_proj`` and ``down_proj``, whose
  partial outputs are summed over the ranks with one ``all_reduce`` each;
- embeddings, norms and the LM head stay replicated.

The attention of each rank then covers its own query heads and KV heads only,
and ``attach(model, ..., tp_rank=rank, tp_size=world_size)`` gives it a kvgen
runtime that allocates pages for those KV heads alone. Every rank runs the
same ``generate()``: the block manager makes identical, deterministic
decisions everywhere, so page tables are never exchanged; only the two
all-reduces per layer cross ranks.

Works with any torch.distributed backend (gloo on CPU, NCCL on GPUs); the
process group must be initialized before ``shard_model`` is called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvgen.errors import KvgenError
from kvgen.integrations.hf_config import head_dim as hf_head_dim, text_config


class TensorParallelError(KvgenError):
    """The model cannot be sharded over the requested number of ranks."""


def head_shard(num_q_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[range, range]:
    """(query heads, KV heads) of ``rank``: KV heads split when they divide, replicated when fewer than ranks."""
    if num_q_heads % world_size:
        raise TensorParallelError(f"{world_size} ranks do not divide {num_q_heads} query heads; pick a divisor")
    if world_size <= num_kv_heads:
        if num_kv_heads % world_size:
            raise TensorParallelError(f"{world_size} ranks do not divide {num_kv_heads} KV heads; pick a divisor")
        per = num_kv_heads // world_size
        kv = range(rank * per, (rank + 1) * per)
    else:
        if world_size % num_kv_heads:
            raise TensorParallelError(
                f"{world_size} ranks exceed {num_kv_heads} KV heads and are not a multiple of them")
        rep = world_size // num_kv_heads
        kv = range(rank // rep, rank // rep + 1)
    per_q = num_q_heads // world_size
    return range(rank * per_q, (rank + 1) * per_q), kv


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = int(rows.numel())


def _keep_cols(linear: nn.Linear, cols: torch.Tensor, keep_bias: bool) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        # The bias is added once, by rank 0, before the sum over ranks.
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = int(cols.numel())


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _all_reduce_output(group: Any):
    def hook(module, inputs, output):
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output
    return hook


def shard_model(model: nn.Module, rank: int, world_size: int, group: Any = None) -> nn.Module:
    """Shard ``model`` (a ``*ForCausalLM`` of the Llama family) in place for ``rank``; returns it."""
    if world_size == 1:
        return model
    if not dist.is_initialized():
        raise TensorParallelError("torch.distributed is not initialized; call init_process_group first")
    cfg = text_config(model.config)
    hq, hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = hf_head_dim(cfg)
    inter = cfg.intermediate_size
    if inter % world_size:
        raise TensorParallelError(f"{world_size} ranks do not divide the intermediate size {inter}")
    q_heads, kv_heads = head_shard(hq, hkv, rank, world_size)
    q_rows, kv_rows = _head_rows(q_heads, head_dim), _head_rows(kv_heads, head_dim)
    per = inter // world_size
    mlp_rows = torch.arange(rank * per, (rank + 1) * per)
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise TensorParallelError(f"{type(model).__name__} has no .model.layers; only Llama-family models are supported")
    reduce_hook = _all_reduce_output(group)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise TensorParallelError(f"attention lacks a Linear {name}; only Llama-family models are supported")
        _keep_rows(attn.q_proj, q_rows)
        _keep_rows(attn.k_proj, kv_rows)
        _keep_rows(attn.v_proj, kv_rows)
        _keep_cols(attn.o_proj, q_rows, keep_bias=rank == 0)
        attn.o_proj.register_forward_hook(reduce_hook)
        # Modules that keep head counts as attributes see their local counts.
        for attr, value in (("num_heads", len(q_heads)), ("num_key_value_heads", len(kv_heads)),
                            ("num_key_value_groups", len(q_heads) // len(kv_heads))):
            if hasattr(attn, attr):
                setattr(attn, attr, value)
        _keep_rows(mlp.gate_proj, mlp_rows)
        _keep_rows(mlp.up_proj, mlp_rows)
        _keep_cols(mlp.down_proj, mlp_rows, keep_bias=rank == 0)
        mlp.down_proj.register_forward_hook(reduce_hook)
    model._kvgen_tp = {"rank": rank, "world_size": world_size, "q_heads": q_heads, "kv_heads": kv_heads}
    return model
