"""The layout context templates see: tile sizes, folded strides, pointer names.

Strides and sizes are computed per spec (a page tensor's shape is already
concrete for the spec's head dim and page size), so the emitted source holds
plain integer constants (Triton then folds them into addressing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvgen.errors import PluginError
from kvgen.schemes import COMPUTE, PageTensor, Scheme

TL_DTYPES = {
    "float16": "tl.float16",
    "bfloat16": "tl.bfloat16",
    "float32": "tl.float32",
    "int8": "tl.int8",
    "uint8": "tl.uint8",
    "int32": "tl.int32",
    "float8_e4m3fn": "tl.float8e4nv",
}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TensorLayout:
    """One page tensor as the templates see it."""

    name: str
    ptr: str          # kernel argument name, e.g. "k_scale_ptr"
    stride: int       # elements between consecutive (page, head) blocks
    dtype: str        # torch dtype name
    tl_dtype: str     # Triton dtype expression
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayoutContext:
    """What a template (and a scheme macro) may read, as ``L``."""

    head_dim: int
    BLOCK_D: int
    PAGE: int
    G: int
    BLOCK_G: int
    H: int
    compute_dtype: str
    tl_compute: str
    t: dict[str, TensorLayout]
    tensor_order: tuple[str, ...]
    macro_template: str
    params: dict[str, Any]

    @property
    def head_dim_align(self) -> int:
        """The largest power of two dividing head_dim: every token's first element in a row-major [PAGE, head_dim]
        page lies at a multiple of it (the float reader's ``tl.multiple_of`` hint)."""
        return self.head_dim & -self.head_dim

    def ptr_args(self) -> str:
        """Kernel parameters for this pool's tensors, comma-joined."""
        return ", ".join(self.t[n].ptr for n in self.tensor_order)

    def ptr_args_typed(self, ctype: str) -> str:
        """C parameter declarations for this pool's tensors: ``const void* k_ptr, const void* v_ptr``."""
        return ", ".join(f"{ctype} {self.t[n].ptr}" for n in self.tensor_order)


def _tensor_layouts(tensors: tuple[PageTensor, ...], compute_dtype: str, prefix: str,
                    head_dim: int, page_size: int) -> dict[str, TensorLayout]:
    out = {}
    for t in tensors:
        # Tensor names become kernel argument names in the source: they must be identifiers.
        if not (isinstance(t.name, str) and t.name.isidentifier()) or t.name.startswith("__"):
            raise PluginError(f"page tensor name {t.name!r} is not a plain Python identifier; name it like 'k_scale'")
        dtype = compute_dtype if t.dtype == COMPUTE else t.dtype
        if dtype not in TL_DTYPES:
            raise PluginError(f"page tensor {t.name} has dtype {t.dtype!r}; use one of {', '.join(TL_DTYPES)}")
        # page_tensors(head_dim, page_size) gives concrete shapes; the stride is their product, a constant.
        stride = math.prod(int(s) for s in t.shape)
        out[t.name] = TensorLayout(
            name=t.name, ptr=f"{prefix}{t.name}_ptr", stride=stride,
            dtype=dtype, tl_dtype=TL_DTYPES[dtype], shape=tuple(t.shape))
    return out


def min_tile(n: int) -> int:
    """tl.dot needs every dimension >= 16."""
    return max(16, next_pow2(n))


def scheme_layout(scheme: Scheme, head_dim: int, page_size: int, gqa_group: int,
                  num_kv_heads: int, compute_dtype: str) -> LayoutContext:
    """The compressed pool of ``scheme`` as a LayoutContext (pointer prefix '')."""
    tensors = scheme.page_tensors(head_dim, page_size)
    return LayoutContext(
        head_dim=head_dim, BLOCK_D=min_tile(head_dim), PAGE=page_size, G=gqa_group,
        BLOCK_G=min_tile(gqa_group), H=num_kv_heads, compute_dtype=compute_dtype,
        tl_compute=TL_DTYPES[compute_dtype],
        t=_tensor_layouts(tensors, compute_dtype, "", head_dim, page_size),
        tensor_order=tuple(t.name for t in tensors), macro_template=scheme.macro_template,
        params={k: v for k, v in scheme.params().items()})


RESIDUAL_MACROS = "triton/schemes/float.j2"


def residual_layout(head_dim: int, page_size: int, gqa_group: int, num_kv_heads: int,
                    compute_dtype: str) -> LayoutContext:
    """The residual pool: k and v pages in the compute dtype, pointers ``rk_ptr``/``rv_ptr``."""
    tensors = (PageTensor("k", COMPUTE, (page_size, head_dim)), PageTensor("v", COMPUTE, (page_size, head_dim)))
    return LayoutContext(
        head_dim=head_dim, BLOCK_D=min_tile(head_dim), PAGE=page_size, G=gqa_group,
        BLOCK_G=min_tile(gqa_group), H=num_kv_heads, compute_dtype=compute_dtype,
        tl_compute=TL_DTYPES[compute_dtype],
        t=_tensor_layouts(tensors, compute_dtype, "r", head_dim, page_size),
        tensor_order=("k", "v"), macro_template=RESIDUAL_MACROS, params={})
