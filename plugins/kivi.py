"""KIVI schemes ``int4`` and ``int2``: per-channel keys, per-token values, fp residual.

KIVI (Liu et al., 2024) quantizes keys per *channel* (key outliers live in a
few channels, so a channel's range is tight) and values per *token* (the
attention output mixes value rows, so a token's error stays local). kvgen
makes the page the key group: a full page of ``P`` tokens is quantized once,
when it fills, and a sequence's most recent tokens stay in the compute dtype
in the residual pool (see ``kvgen.schemes``):

- ``int4``: ``residual_tokens = 0``: only the last, partly filled page is
  kept in the compute dtype; a page is quantized as soon as it is full.
- ``int2``: ``residual_tokens = 128`` (KIVI's R): the partial tail page and
  the 128 most recent tokens as whole pages stay exact; so the page size must
  divide 128.

Both take the option ``residual`` (``--kv int4:residual=64``): the tokens
kept exact as whole pages besides the partial tail page, 0 or a multiple of
the page size. The planner reserves the residual pool from it, so capacity
follows.

Codes are asymmetric with round-to-nearest: ``x ~= code * scale + zero``,
``zero`` is the group's minimum and ``scale = (max - min) / (2**bits - 1)``,
both stored as float16 (codes are computed against the float16-rounded
values, so the error bound is ``scale / 2`` plus float16 rounding of
``zero``). A group with no range (constant, or a range that underflows in
float16) stores ``scale = 0`` and codes 0, and dequantizes to ``zero``.

Numerics (the same for every scheme; see ``tests/kernels/test_numerics.py``):

- Finite K/V never give NaN/Inf. Inputs are clamped to +-``FP16_LIMIT``
  (65440: float16's 65504 less two top ulps; only float32/bfloat16 compute
  can hold more, and such values saturate), and the scale is capped (rounded
  toward zero) so that ``zero + levels * scale <= 65440`` and ``C * scale <=
  65504`` with ``C = 2**bits / 2``. The float16 decode path dequantizes
  ``(code - C) * scale + (zero + C * scale)``, whose every intermediate then
  stays finite for any channel range (``code * scale + zero`` overflowed
  once a range passed 65504). The cap only binds for groups reaching the
  limit. The CUDA decode kernel (plugins/macros/cuda/kivi.j2) folds the
  key scales into q instead and rounds ``q' * k_scale`` to float16, with
  q' = q * sm_scale * log2(e) times a power of two per warp that brings
  its largest element to at most ``C``: by the cap, every product stays
  within 65504.
- Non-finite K/V propagate: a NaN or an Inf stores its group's scale as NaN
  (the key channel of its page, or its token's value group), so it reads
  back as NaN and every query attending that page (keys) or token (values)
  gets a NaN output, as over a float page. Its codes and zero are those of
  the group with the non-finite entries taken as 0. Tokens still in the
  residual pool are float pages (IEEE arithmetic, as SDPA).

Layout per (page, KV head); ``F = 8 // bits`` codes per byte (2 for int4, 4
for int2), ``G = gcd(32, D)`` value group (32 for D = 64, 96, 128, 256; 16
for D = 80; 8 for D = 8)::

    k        uint8   [P, D/F]   codes, token-major, packed along channels
    k_scale  float16 [D]        one per channel, over the page's P tokens, in key-metadata order (below)
    k_zero   float16 [D]        in the same order
    v        uint8   [P, D/F]   codes, token-major, packed along channels
    v_scale  float16 [P, D/G]   one per (token, group of G channels)
    v_zero   float16 [P, D/G]

    byte j of token t (int4):  bits 7..4 = channel 2j+1 | bits 3..0 = channel 2j
    byte j of token t (int2):  [c 4j+3 | c 4j+2 | c 4j+1 | c 4j]  (2 bits each, low first)

Key-metadata order (:func:`key_meta_positions`): channel ``d``'s scale and zero are stored at position
``pos(d)``, a permutation inside each group of ``W = 32 // bits`` channels (the codes of one 32-bit word of
a key row): for int4, bit-reversed positions (0 4 2 6 1 5 3 7); for int2, ``pos`` takes channel bits (3 2 1
0) to position bits (0 3 1 2). A trailing group narrower than W (int2 at D=8) is stored as is. The CUDA
decode (``macros/cuda/kivi.j2``) reads the words of its key operands straight out of this order: each pair
it multiplies into a score (channels i and i + W/2, the two halves of a register) is one stored word, and
the zeros of two k-steps are one aligned 16-byte load that is an MMA operand as it stands; in channel order
both took a byte permute each (32 of the 501 instructions of int4's decode tile loop). The Triton kernels
index the order with the same arithmetic.

Packing interleaves neighbouring channels in one byte (channel ``F*j + i``
in bits ``[i*bits, (i+1)*bits)``). A group of F channels never straddles the
padded power-of-two ``BLOCK_D`` tile, whatever D is (80 and 96 included), so
packing in ``store_page`` is a reshape ``[P, BLOCK_D/F, F]`` and a
shift-sum, and unpacking in the decode loop is one contiguous (vectorizable)
byte load of ``[N, BLOCK_D/F]``, F shift+mask ops and ``tl.join`` +
reshape back to channel order; no lane shuffle depends on D. Split halves
(byte j = channels j and j + D/2) would align only when D is a power of two.

The value group is ``gcd(32, D)``, the largest power of two <= 32 dividing D,
so groups tile D exactly (no partial groups, no cross-group padding) and a
group never straddles the padded tile either; ``head_dims`` lists the sizes
the kernel matrix covers, all multiples of 8.

Bytes per token per KV head (``bytes_per_token_expr``), D = 128, P = 16:
int4: K 64 codes + 32 (4*D bytes of scale/zero per page, amortized over
16 tokens) + V 64 codes + 16 (4 groups * 2 * 2 bytes) = 176 (0.34 of fp16's
512); int2: 32 + 32 + 32 + 16 = 112 (0.22). The residual pages are not in
the compressed pool and not counted here.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import math
from typing import TYPE_CHECKING

from kvgen.plugin_api import (FP16_LIMIT, PageTensor, Scheme, SchemeOptionError, half_toward_zero, hookimpl,
                              lazy_import, split_nonfinite)
from kvgen.schemes import symbols

if TYPE_CHECKING:
    import sympy

# Only the reference quantize/dequantize need torch, and only bytes-per-token needs sympy: listing never loads them.
torch = lazy_import("torch")

VALUE_GROUP = 32
"""KIVI's value group; shrunk to gcd(32, D) for head dims it does not divide."""


def value_group(head_dim: int) -> int:
    """Channels per value scale group: the largest power of two <= 32 dividing ``head_dim``."""
    return math.gcd(VALUE_GROUP, head_dim)


@functools.lru_cache(maxsize=1)
def _kivi_group_function() -> type:
    import sympy

    class kivi_group(sympy.Function):
        """``gcd(32, D)`` as a sympy function, so bytes-per-token stays exact for any D."""

        @classmethod
        def eval(cls, d):
            if d.is_Integer:
                return sympy.Integer(value_group(int(d)))
            return None

    return kivi_group


def kivi_group(d: "sympy.Expr") -> "sympy.Expr":
    """``gcd(32, d)`` as a sympy expression (a sympy function, defined on first use so sympy loads only then)."""
    return _kivi_group_function()(d)


def _quantize(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest codes of float32 ``x`` over ``dim``: (codes uint8, scale fp16, zero fp16), keepdim.

    Inputs are clamped to +-``FP16_LIMIT`` (:data:`kvgen.plugin_api.FP16_LIMIT`), and the scale is
    capped so that ``scale <= 65504 / C`` and ``zero + levels * scale <= FP16_LIMIT`` (``C = (levels
    + 1) // 2``): every value and intermediate of the float16 decode path ``(code - C) * scale + (zero
    + C * scale)`` (``kivi.j2``) stays finite, roundings included; only groups reaching the limit
    are affected. A group holding a NaN or an Inf stores
    scale NaN (``x * 0`` summed over the group), so it dequantizes to NaN;
    its codes and zero are those of the group with the non-finite entries
    set to 0. The macros in ``kivi.j2`` run the same arithmetic.
    """
    x, zeros = split_nonfinite(x)
    bad = zeros.sum(dim, keepdim=True)
    x = x.clamp(-FP16_LIMIT, FP16_LIMIT)
    mn = x.amin(dim, keepdim=True)
    mx = x.amax(dim, keepdim=True)
    zero = mn.to(torch.float16)
    cap = ((FP16_LIMIT - zero.float()) / levels).clamp(max=65504.0 / ((levels + 1) // 2))
    scale = torch.minimum(((mx - mn) / levels).to(torch.float16), half_toward_zero(cap))
    s, z = scale.float(), zero.float()
    ok = s > 0
    # floor(y + 0.5) rather than torch.round: the kernels round half up too, and codes must match. The kernels
    # multiply by the group's reciprocal (one correctly rounded division a group) and add the 0.5 in the same
    # fma: (x - z) * r is exact in float64 (24 + 24 bits) and so is adding 0.5 wherever the floor can depend on
    # it (|(x - z) * r| >= 1/4 there), so one rounding to float32 after it is the fma's.
    r = 1.0 / torch.where(ok, s, torch.ones_like(s))
    code = torch.floor(((x - z).double() * r.double() + 0.5).float()).clamp_(0, levels)
    code = torch.where(ok, code, torch.zeros_like(code))
    return code.to(torch.uint8), scale + bad.to(torch.float16), zero


def key_meta_positions(head_dim: int, bits: int) -> list[int]:
    """``pos[d]``: where channel ``d``'s key scale and zero are stored in a page's ``k_scale``/``k_zero`` rows.

    Inside each whole group of ``W = 32 // bits`` channels, with ``c = d % W``, ``r = (c >> 1) % (W // 4)``:
    ``pos = d - c + 8 * (r >> 1) + 4 * (c & 1) + 2 * (r & 1) + (c >= W // 2)`` (the CUDA reader's word of
    k-step pair ``r >> 1``, slot pair ``c & 1``, k-step parity ``r & 1``, half ``c >= W // 2``); channels of
    a trailing partial group keep their place. ``macros/kivi.j2`` (``_kpos``) emits the same arithmetic.
    """
    w = 32 // bits
    whole = head_dim // w * w
    out = []
    for d in range(head_dim):
        c = d % w
        r = (c >> 1) % (w // 4)
        out.append(d - c + 8 * (r >> 1) + 4 * (c & 1) + 2 * (r & 1) + int(c >= w // 2) if d < whole else d)
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` codes -> ``[..., D/F]`` uint8; channel F*j+i in bits [i*bits, (i+1)*bits) of byte j."""
    f = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // f, f)
    out = c[..., 0].clone()
    for i in range(1, f):
        out |= c[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D/F]`` uint8 -> ``[..., D]`` uint8 codes."""
    f = 8 // bits
    mask = (1 << bits) - 1
    c = torch.stack([(packed >> (i * bits)) & mask for i in range(f)], -1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * f)


class KiviScheme(Scheme):
    """KIVI: keys per channel over the page, values per token in groups of gcd(32, D) channels."""

    macro_template = "kivi.j2"
    head_dims = (8, 64, 80, 96, 128, 256)
    tolerance = 2e-3
    options = {
        "residual": ("tokens kept exact (compute dtype) as whole pages besides the partial tail page: 0 or a "
                     "multiple of the page size (int4 default 0, int2 default 128)"),
    }

    max_residual = 2**20
    """The most tokens option ``residual`` accepts (KIVI uses 32 to 128); far below any pool-size overflow."""

    def configure(self, residual: str | None = None) -> "KiviScheme":
        new = copy.copy(self)
        if residual is not None:
            try:
                tokens = int(residual)
            except ValueError:
                tokens = -1
            if tokens < 0:
                raise SchemeOptionError(f"scheme {self.name}: option residual must be a whole number of tokens >= 0, "
                                        f"got {residual!r}")
            # 10**21 once planned and then overflowed only at load().
            if tokens > self.max_residual:
                raise SchemeOptionError(f"scheme {self.name}: option residual={residual} is more than {self.max_residual} "
                                        f"tokens; use 0 or a multiple of {min(self.page_sizes)} up to {self.max_residual}")
            # Residual pages are whole pages: a residual no supported page size divides can never plan.
            fits = [p for p in self.page_sizes if tokens % p == 0]
            if not fits:
                step = min(self.page_sizes)
                below, above = tokens // step * step, (tokens // step + 1) * step
                raise SchemeOptionError(
                    f"scheme {self.name}: option residual={residual} is not a whole number of pages for any page size "
                    f"it supports ({', '.join(map(str, self.page_sizes))}); use 0 or a multiple of {step} "
                    f"(e.g. {below} or {above})")
            new.residual_tokens = tokens
        return new

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        f = 8 // self.bits
        g = value_group(head_dim)
        return (
            PageTensor("k", "uint8", (page_size, head_dim // f)),
            PageTensor("k_scale", "float16", (head_dim,)),
            PageTensor("k_zero", "float16", (head_dim,)),
            PageTensor("v", "uint8", (page_size, head_dim // f)),
            PageTensor("v_scale", "float16", (page_size, head_dim // g)),
            PageTensor("v_zero", "float16", (page_size, head_dim // g)),
        )

    def bytes_per_token_expr(self) -> sympy.Expr:
        # Exact for every D: the value group is gcd(32, D), not linear in D, so the
        # base class's four-sample fit would be wrong for D = 80 (or 8).
        d, p = symbols()
        codes = 2 * p * d * self.bits / 8          # K and V codes
        k_meta = 2 * 2 * d                         # k_scale + k_zero, float16, per page
        v_meta = 2 * 2 * p * d / kivi_group(d)     # v_scale + v_zero, float16, per token group
        return (codes + k_meta + v_meta) / p

    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        h, page, d = k.shape
        if d % 8:
            raise ValueError(f"scheme {self.name}: head_dim must be a multiple of 8, got {d}")
        g = value_group(d)
        kc, ks, kz = _quantize(k.float(), 1, self.levels)               # over the page's tokens
        vc, vs, vz = _quantize(v.float().reshape(h, page, d // g, g), 3, self.levels)
        pos = torch.tensor(key_meta_positions(d, self.bits))
        ks_stored, kz_stored = torch.empty_like(ks.reshape(h, d)), torch.empty_like(kz.reshape(h, d))
        ks_stored[:, pos], kz_stored[:, pos] = ks.reshape(h, d), kz.reshape(h, d)
        return {
            "k": pack(kc, self.bits),
            "k_scale": ks_stored,
            "k_zero": kz_stored,
            "v": pack(vc.reshape(h, page, d), self.bits),
            "v_scale": vs.reshape(h, page, d // g),
            "v_zero": vz.reshape(h, page, d // g),
        }

    def dequantize_page(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = value_group(head_dim)
        kc = unpack(tensors["k"], self.bits).float()                     # [H, P, D]
        ks, kz = self.key_meta(tensors, head_dim)
        k = kc * ks[:, None, :] + kz[:, None, :]
        vc = unpack(tensors["v"], self.bits).float()
        h, page, _ = vc.shape
        vc = vc.reshape(h, page, head_dim // g, g)
        v = vc * tensors["v_scale"].float()[..., None] + tensors["v_zero"].float()[..., None]
        return k, v.reshape(h, page, head_dim)

    def key_meta(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A page's key scales and zeros in channel order (float32 ``[..., D]``), from its stored order."""
        pos = torch.tensor(key_meta_positions(head_dim, self.bits), device=tensors["k_scale"].device)
        return tensors["k_scale"].float()[..., pos], tensors["k_zero"].float()[..., pos]

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Page-by-page roundtrip; keys are grouped per page, so the page size matters.

        ``page_size`` None treats the whole token axis as one page (the base
        class's signature); pass it for multi-page input.
        """
        h, n, d = k.shape
        page = page_size or n
        if n % page:
            raise ValueError(f"{n} tokens is not a whole number of {page}-token pages")
        ks, vs = [], []
        for i in range(0, n, page):
            kk, vv = self.dequantize_page(self.quantize_page(k[:, i:i + page], v[:, i:i + page]), d)
            ks.append(kk)
            vs.append(vv)
        return torch.cat(ks, 1), torch.cat(vs, 1)

    def params(self):
        return {**super().params(), "key_group": "page", "value_group": VALUE_GROUP}


class Int4(KiviScheme):
    name = "int4"
    bits = 4
    residual_tokens = 0
    expected_error = 0.10  # measured: attention rel. L2 vs fp32, random normal data, D=128, page 16
    page_sizes = (8, 16, 32, 64, 128)
    summary = "KIVI 4-bit: keys per channel over each page, values per token in groups of 32; partial tail page in fp"


class Int2(KiviScheme):
    name = "int2"
    bits = 2
    residual_tokens = 128
    expected_error = 0.54  # measured as for int4
    page_sizes = (16, 32, 64, 128)
    summary = "KIVI 2-bit: keys per channel over each page, values per token in groups of 32; last 128 tokens in fp"


@hookimpl
def kvgen_register_schemes(register):
    register(Int4())
    register(Int2())


@hookimpl
def kvgen_register_templates(register):
    # kivi.j2 ships in this package's macros/ (each built-in registers what it uses: KVGEN_PLUGINS=kivi works alone).
    register(importlib.resources.files("kvgen_plugins") / "macros")
