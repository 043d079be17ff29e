"""Built-in int8 scheme: symmetric int8 codes, one float32 scale per token and KV head.

Layout (per page and KV head, each tensor contiguous; K and V quantized
separately)::

    k       int8    [page_size, head_dim]   codes, row t = token t
    k_scale float32 [page_size]             scale of token t's key
    v       int8    [page_size, head_dim]
    v_scale float32 [page_size]

    page p, head h:  k       + (p*H + h) * page_size*head_dim -> [t0: c0 .. cD-1][t1: ...]...
                     k_scale + (p*H + h) * page_size          -> [s_t0][s_t1]...

    value(t, d) = code[t, d] * scale[t]
    scale[t] = max_d |x[t, d]| / 127; code = round-half-away-from-zero(x * (1 / scale)), in [-127, 127]

Per-token scales make every token independent (written the moment it
arrives, no residual window: ``residual_tokens = None``), and they sit on
the attention dots' contraction axis, so the kernels fold them out of the
inner loop: scores = (q . k_codes) * k_scale, acc += (p * v_scale) . v_codes.
Storage: 2*D + 8 bytes per token and KV head (K and V).

Numerics (the same for every scheme; see ``tests/kernels/test_numerics.py``):
a token holding a NaN or an Inf stores scale NaN, so it reads back as NaN and
every query attending it gets a NaN output, as over a float page; finite
input never gives NaN/Inf (float32 scales, codes in [-127, 127]). With
bfloat16 compute the 16-bit dots run in float16, so there q and a token's
|V| must stay below 65504.
"""

from __future__ import annotations

import importlib.resources

from kvgen.plugin_api import PageTensor, Scheme, hookimpl, lazy_import, split_nonfinite

torch = lazy_import("torch")  # only the reference quantize/dequantize need it; listing and planning never load it


def quantize_tokens(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric scaling of ``x [..., D]``: (y = x * (1 / scale), scale [...]), shared by int8 and fp8.

    ``scale = amax / qmax``; an all-zero token divides by 1 (and keeps scale 0).
    Float32 throughout, in the same operation order as the kernels' macros:
    one correctly rounded reciprocal per token, then one rounded multiply per
    element (a division per element made the GPU cache write arithmetic-bound).

    Non-finite input: a token holding a NaN or an Inf gets scale NaN (``x * 0``
    summed over the token is 0, or NaN), so it dequantizes to NaN everywhere
    and attention over it is NaN, as over a float page; its codes are those
    of the token with the non-finite entries set to 0 (defined, the same in
    the kernels). The macros compute the marker the same way; ``amax``
    alone would not do, as GPU max reductions skip NaN.
    """
    x, zeros = split_nonfinite(x.float())
    bad = zeros.sum(-1)
    amax = x.abs().amax(-1)
    scale = amax / qmax
    inv = 1.0 / torch.where(amax > 0, scale, torch.ones_like(scale))
    return x * inv[..., None], scale + bad


class Int8Scheme(Scheme):
    """Symmetric int8 with one float32 scale per token and KV head (K and V separately)."""

    name = "int8"
    bits = 8
    summary = "int8 codes, one fp32 scale per token and KV head (K and V separately)"
    macro_template = "int8.j2"
    residual_tokens = None
    tolerance = 2e-3
    # rel L2 of attention over this cache vs float32, random normal data, D=128 (matches docs ANCHORS)
    expected_error = 0.0095

    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        return (PageTensor("k", "int8", (page_size, head_dim)),
                PageTensor("k_scale", "float32", (page_size,)),
                PageTensor("v", "int8", (page_size, head_dim)),
                PageTensor("v_scale", "float32", (page_size,)))

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, scale = quantize_tokens(x, 127.0)
        code = torch.trunc(y + torch.where(y >= 0, 0.5, -0.5)).clamp(-127, 127)
        return code.to(torch.int8), scale

    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        kc, ks = self._quantize(k)
        vc, vs = self._quantize(v)
        return {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}

    def dequantize_page(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = tensors["k"].float() * tensors["k_scale"].float()[..., None]
        v = tensors["v"].float() * tensors["v_scale"].float()[..., None]
        return k, v


@hookimpl
def kvgen_register_schemes(register):
    register(Int8Scheme())


@hookimpl
def kvgen_register_templates(register):
    # int8.j2 ships in this package's macros/ (each built-in registers what it uses: KVGEN_PLUGINS=int8 works alone).
    register(importlib.resources.files("kvgen_plugins") / "macros")
