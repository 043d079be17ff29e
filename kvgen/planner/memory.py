"""The memory model, written once in sympy.

Every byte count the planner reports is one of these expressions with the
model's, target's, workload's and scheme's numbers substituted, so the plan
can print the formula next to its value and a test can recompute it.
"""

from __future__ import annotations

import sympy

from kvgen.schemes import D, P

layers, kv_heads, kv_heads_gpu, tp = sympy.symbols("layers kv_heads kv_heads_per_gpu tp", positive=True, integer=True)
params, weight_bits = sympy.symbols("params weight_bits", positive=True)
memory, util, workspace = sympy.symbols("memory util workspace", positive=True)
bytes_per_head = sympy.Symbol("b_head", positive=True)  # scheme's bytes per token per KV head, b(D, P)

KV_BYTES_PER_TOKEN = layers * kv_heads * bytes_per_head
"""K+V bytes one token costs in the whole model (all layers, all KV heads)."""

KV_BYTES_PER_TOKEN_PER_GPU = layers * kv_heads_gpu * bytes_per_head
"""K+V bytes one token costs on one GPU (its KV heads only)."""

WEIGHT_BYTES = params * weight_bits / 8
WEIGHT_BYTES_PER_GPU = WEIGHT_BYTES / tp
KV_BUDGET = memory * util - WEIGHT_BYTES_PER_GPU - workspace
"""Bytes per GPU left for KV pages."""

WORKSPACE_BYTES = 2 * 2**30
"""Reserved per GPU for the CUDA context, allocator slack and one step's activations."""


def scheme_bytes_per_token(expr: sympy.Expr, head_dim: int, page_size: int) -> sympy.Rational:
    """Substitute a scheme's b(D, P) expression; exact rational."""
    return sympy.nsimplify(expr.subs({D: head_dim, P: page_size}))


def show(name: str, expr: sympy.Expr, values: dict) -> str:
    """``name = formula = formula-with-numbers = value`` as one line."""
    substituted = sympy.sstr(expr.subs({k: sympy.Symbol(str(v)) for k, v in values.items()}))
    value = expr.subs(values)
    return f"{name} = {sympy.sstr(expr)} = {substituted} = {int(sympy.floor(value)):,}"
