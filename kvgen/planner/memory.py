"""The memory model, written once as formulas over named quantities.

Every byte count the planner reports is one of these formulas with the
model's, target's, workload's and scheme's numbers substituted, so the plan
can print the formula next to its value and a test can recompute it.

A formula is Python arithmetic (``+ - * /`` and parentheses) over the
names below, evaluated exactly with :class:`fractions.Fraction`. This used
to be sympy; sympy costs 0.3-0.5 s to import and the model is four products
and a difference, so ``kvgen plan`` and ``kvgen compile`` no longer load it
(sympy stays the language of a scheme's ``bytes_per_token_expr``, built only
when asked for).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Mapping

# The names a formula may use (each documented where the planner fills it in).
layers, kv_heads, kv_heads_gpu, tp = "layers", "kv_heads", "kv_heads_per_gpu", "tp"
params, weight_bits = "params", "weight_bits"
memory, util, workspace = "memory", "util", "workspace"
bytes_per_head = "b_head"  # scheme's bytes per token per KV head, b(D, P): Scheme.page_bytes_per_token
NAMES = frozenset({layers, kv_heads, kv_heads_gpu, tp, params, weight_bits, memory, util, workspace, bytes_per_head})

_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


class Formula:
    """One formula of the model: ``text`` (Python arithmetic over :data:`NAMES`), evaluated exactly."""

    def __init__(self, text: str):
        unknown = set(_NAME.findall(text)) - NAMES
        if unknown:
            raise ValueError(f"formula {text!r} uses unknown names {sorted(unknown)}")
        self.text = text
        self._code = compile(text, "<memory model>", "eval")

    def value(self, values: Mapping[str, int | Fraction]) -> Fraction:
        """The exact value with ``values`` (name -> int or Fraction) substituted."""
        # The text is kvgen's own constant (never user input) and names only numbers: eval is exact arithmetic.
        return Fraction(eval(self._code, {"__builtins__": {}}, {k: Fraction(v) for k, v in values.items()}))

    def substituted(self, values: Mapping[str, int | Fraction]) -> str:
        """The text with each name replaced by its number (a non-integer in parentheses: ``(9/10)``)."""
        def number(m: re.Match) -> str:
            v = Fraction(values[m.group(0)])
            return str(v.numerator) if v.denominator == 1 else f"({v})"

        return _NAME.sub(number, self.text)

    def __str__(self) -> str:
        return self.text


KV_BYTES_PER_TOKEN = Formula("b_head*kv_heads*layers")
"""K+V bytes one token costs in the whole model (all layers, all KV heads)."""

KV_BYTES_PER_TOKEN_PER_GPU = Formula("b_head*kv_heads_per_gpu*layers")
"""K+V bytes one token costs on one GPU (its KV heads only)."""

WEIGHT_BYTES_PER_GPU = Formula("params*weight_bits/(8*tp)")
KV_BUDGET = Formula(f"memory*util - {WEIGHT_BYTES_PER_GPU} - workspace")
"""Bytes per GPU left for KV pages."""

WORKSPACE_BYTES = 2 * 2**30
"""Reserved per GPU for the CUDA context, allocator slack and one step's activations."""


def exact(x: float) -> Fraction:
    """A user's decimal (``--gpu-memory-utilization 0.9``) as the fraction it reads as (9/10, not the binary float)."""
    return Fraction(repr(float(x)))


def show(name: str, formula: Formula, values: Mapping[str, int | Fraction]) -> str:
    """``name = formula = formula-with-numbers = value`` as one line (value rounded down)."""
    return f"{name} = {formula} = {formula.substituted(values)} = {math.floor(formula.value(values)):,}"
