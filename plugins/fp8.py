"""Built-in fp8 scheme: float8 e4m3 codes, one float32 scale per token and KV head.

Layout (per page and KV head, each tensor contiguous; K and V quantized
separately)::

    k       uint8   [page_size, head_dim]   e4m3fn bit patterns, row t = token t
    k_scale float32 [page_size]             scale of token t's key
    v       uint8   [page_size, head_dim]
    v_scale float32 [page_size]

    page p, head h:  k       + (p*H + h) * page_size*head_dim -> [t0: c0 .. cD-1][t1: ...]...
                     k_scale + (p*H + h) * page_size          -> [s_t0][s_t1]...

    value(t, d) = e4m3(code[t, d]) * scale[t]      (torch: code.view(torch.float8_e4m3fn))
    scale[t] = max_d |x[t, d]| / 448; code = float8_e4m3fn(x * (1 / scale)), round to nearest even

The codes are torch.float8_e4m3fn values stored as their bytes (uint8), so the
kernels decode them with integer arithmetic: no float8 type reaches Triton,
the scheme runs on every GPU arch (``min_arch = 0``) and in the CPU
interpreter. Per-token scales fold out of the dots as in int8. No residual
window (``residual_tokens = None``). Storage: 2*D + 8 bytes per token and KV head.

Numerics (the same for every scheme; see ``tests/kernels/test_numerics.py``):
as int8, a token holding a NaN or an Inf stores scale NaN and reads back as
NaN (every query attending it gets a NaN output, as over a float page);
finite input never gives NaN/Inf (with bfloat16 compute the dots run in
float16, so there q and a token's |V| must stay below 65504).
"""

from __future__ import annotations

import importlib.resources

from kvgen.plugin_api import PageTensor, Scheme, hookimpl, lazy_import

from .int8 import quantize_tokens

torch = lazy_import("torch")  # only the reference quantize/dequantize need it; listing and planning never load it

E4M3_MAX = 448.0


class Fp8Scheme(Scheme):
    """float8 e4m3 (as uint8 bits) with one float32 scale per token and KV head (K and V separately)."""

    name = "fp8"
    bits = 8
    summary = "float8 e4m3 codes, one fp32 scale per token and KV head (K and V separately)"
    macro_template = "fp8.j2"
    residual_tokens = None
    min_arch = 0
    tolerance = 2e-3
    # rel L2 of attention over this cache vs float32, random normal data, D=128 (matches docs ANCHORS)
    expected_error = 0.037

    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        return (PageTensor("k", "uint8", (page_size, head_dim)),
                PageTensor("k_scale", "float32", (page_size,)),
                PageTensor("v", "uint8", (page_size, head_dim)),
                PageTensor("v_scale", "float32", (page_size,)))

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, scale = quantize_tokens(x, E4M3_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8), scale

    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        kc, ks = self._quantize(k)
        vc, vs = self._quantize(v)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}

    def dequantize_page(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        def deq(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return codes.contiguous().view(torch.float8_e4m3fn).float() * scale.float()[..., None]
        return deq(tensors["k"], tensors["k_scale"]), deq(tensors["v"], tensors["v_scale"])


@hookimpl
def kvgen_register_schemes(register):
    register(Fp8Scheme())


@hookimpl
def kvgen_register_templates(register):
    # fp8.j2 ships in this package's macros/ (each built-in registers what it uses: KVGEN_PLUGINS=fp8 works alone).
    register(importlib.resources.files("kvgen_plugins") / "macros")
