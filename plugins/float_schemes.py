"""Built-in uncompressed schemes: fp32, fp16, bf16 (a plugin like any other).

Layout (per page and KV head, contiguous, in the scheme's dtype)::

    k: [page_size, head_dim]     v: [page_size, head_dim]

``quantize_page`` is a cast; ``dequantize_page`` casts back to float32.
Tokens are written straight into their page (no residual window).

Numerics (the same for every scheme; see ``tests/kernels/test_numerics.py``):
pages hold what was written, and attention is IEEE arithmetic, as SDPA: a NaN
in K or V makes every query attending it NaN; an Inf in V gives Inf/NaN; an
Inf in K gives a NaN output, or, where its score is -inf, weight 0 (the one
case where a non-finite input leaves the output finite, as in SDPA). A cast
to a narrower page dtype (fp16 pages under float32 compute) turns values
past its range into Inf.
"""

from __future__ import annotations

from kvgen.plugin_api import PageTensor, Scheme, hookimpl, lazy_import

torch = lazy_import("torch")  # only the reference quantize/dequantize need it; listing and planning never load it


class FloatScheme(Scheme):
    """Pages stored as-is in one floating dtype."""

    dtype_name: str
    macro_template = "triton/schemes/float.j2"
    residual_tokens = None
    tolerance = 2e-3

    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        return (PageTensor("k", self.dtype_name, (page_size, head_dim)),
                PageTensor("v", self.dtype_name, (page_size, head_dim)))

    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = getattr(torch, self.dtype_name)
        return {"k": k.to(dtype), "v": v.to(dtype)}

    def dequantize_page(self, tensors, head_dim):
        return tensors["k"].float(), tensors["v"].float()

    def params(self):
        return {**super().params(), "dtype": self.dtype_name}


class FP32(FloatScheme):
    name = "fp32"
    bits = 32
    dtype_name = "float32"
    summary = "no compression, float32 pages (exact reference for CPU tests)"
    expected_error = 0.0


class FP16(FloatScheme):
    name = "fp16"
    bits = 16
    dtype_name = "float16"
    summary = "no compression, float16 pages"
    expected_error = 5e-4


class BF16(FloatScheme):
    name = "bf16"
    bits = 16
    dtype_name = "bfloat16"
    summary = "no compression, bfloat16 pages"
    expected_error = 4e-3


@hookimpl
def kvgen_register_schemes(register):
    for cls in (FP32, FP16, BF16):
        register(cls())

# No kvgen_register_templates: float.j2 is kvgen's own (templates/triton/schemes), which the residual pool uses too.
