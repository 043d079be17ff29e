"""``nuq4``: non-uniform 4-bit keys (k-means codebook) with fp16 outliers, 4-bit values.

After KVQuant (Hooper et al., 2024): key channels have very different
ranges and a bell-shaped, not flat, distribution, so keys are quantized per
*channel* against a *non-uniform* 16-level codebook fitted offline by
k-means on real keys, and the few largest entries are kept exactly. Values
are quantized per *token* with uniform asymmetric 4-bit groups (as KIVI's
int4 does), because the attention output mixes value rows and a token's
error stays local.

Keys, per page (the page is the per-channel group, as in KIVI; a page is
quantized once, when it fills: ``residual_tokens = 0``, so only a sequence's
last, partly filled page stays in the compute dtype):

1. **Outliers, per token.** Each token keeps its ``NO = max(1, D // 100)``
   largest-magnitude entries (the top 1% per token, at least one) exactly,
   as (channel index uint8, value float16). A fixed count per token is a
   dense ``[P, NO]`` table, so it fits the page layout with no variable-size
   structure; the decode loop restores them with NO ``tl.where`` per tile.
   (Per-page outlier *channels* were the alternative; per-token outliers
   were kept because they also catch single-token spikes, e.g. attention
   sinks, and a massive channel that is every token's top entry ends up
   entirely exact anyway.)
2. **Per-channel range** over the page's inliers: ``zero = (max+min)/2``,
   ``scale = (max-min)/2`` (float16), so inliers normalize into ``[-1, 1]``.
3. **Codes**: the nearest level of the codebook (16 ascending float32
   levels in about ``[-1, 1]``), i.e. the number of level midpoints the
   normalized value is above. Dequantized key: ``cb[code] * scale + zero``,
   then each token's outliers overwrite their channels.

The codebook is part of the scheme's parameters (``params()['codebooks']``,
one per page size: the normalized distribution depends on how many tokens
share a channel's range) and is baked into the rendered kernels as 16 float
constants: the decode loop maps 4-bit codes to levels with a 4-level
``tl.where`` select tree on the code bits (15 selects, no memory traffic).
It is one codebook for all layers, the ``pooled`` codebook of the shipped
calibration file (``codebooks/stories260K.json``, fitted on post-RoPE keys
of stories260K over TinyStories text). The scheme option ``codebook``
selects another file written by ``kvgen nuq calibrate``, or a shipped one by
name: ``--kv nuq4:codebook=my.json``, ``--kv nuq4:codebook=smollm2-135m``
(SmolLM2-135M-Instruct on tinyshakespeare). The codebook then goes into the
plan's ``scheme_params`` and the kernels' specs, so each codebook gets its own
kernels. ``KVGEN_NUQ_CODEBOOK=FILE`` (the older way, kept for backward
compatibility) changes the default used when the option is not given. The
page sizes the scheme declares are those its file has codebooks for. The file also holds one
codebook per layer, which kvgen's kernels cannot use yet: the scheme
contract has no per-layer state (see docs/plugin-guide.md, "API gaps").

What each part buys (relative L2 error vs float32; page 16 unless said):

- random normal K (D = 128): key error int4 0.065, nuq4 with uniform levels
  (mid-range zero + outliers) 0.062, nuq4 0.060; page 64: 0.090 / 0.083 /
  0.077. Per-page min/max normalization over few tokens leaves an almost
  flat distribution, so the codebook's gain grows with the page size.
- stories260K (D = 8, one outlier = 1/8 of a token's entries, so nuq4
  costs 17 B/token/head there vs int4's 14): attention error with quantized
  K only 0.152 (int4) vs 0.125 (nuq4), with K and V 0.158 vs 0.133;
  per-layer codebooks instead of the pooled one: 0.1253 vs 0.1251 (no gain
  on this model). ``kvgen eval`` (reference backend, 7,265 tokens):
  perplexity +0.77% (int4) vs +0.22% (nuq4) over the float32 cache.
- SmolLM2-135M (D = 64, 91 vs 88 B/token/head), post-RoPE K/V/Q of 2048
  held-out tinyshakespeare tokens: attention error with quantized K only
  0.0509 (int4) vs 0.0478 (nuq4, stories codebook); K and V 0.0775 vs
  0.0753. Its own pooled codebook (``codebooks/smollm2-135m.json``): 0.0478;
  per-layer: 0.0479; uniform levels: 0.0481. The shipped stories260K
  codebook transfers: at page 16 every fitted codebook is close to uniform.

Values, per token, groups of ``G = gcd(32, D)`` channels: ``v ~= code *
scale + zero``, ``zero`` the group minimum, ``scale = (max - min) / 15``
(float16), round half up, exactly KIVI int4's value format.

Numerics (the same for every scheme; see kvgen's tests/kernels/test_numerics.py):
finite K/V never give NaN/Inf: inputs are clamped to +-``FP16_LIMIT`` (65440,
float16's 65504 less two top ulps; only float32/bfloat16 compute hold more,
and it saturates) and the key scale is capped so that ``|level| * scale +
|zero|`` stays within it. Non-finite K/V propagate: a token whose key holds a
NaN or an Inf stores its first outlier value as NaN, a value group holding
one stores its scale as NaN, so the token reads back as NaN and every query
attending it gets a NaN output, as over a float page (codes, scales and
zeros are otherwise those of the input with the non-finite entries taken as 0).

Layout per (page, KV head), ``P`` tokens, ``D`` channels, codes packed two
per byte (channel ``2j`` in bits 3..0, ``2j+1`` in bits 7..4 of byte ``j``)::

    k        uint8   [P, D/2]    4-bit codebook indices, token-major
    k_scale  float16 [D]         per channel, over the page's inlier entries
    k_zero   float16 [D]
    k_oidx   uint8   [P, NO]     channel of each of the token's outliers
    k_oval   float16 [P, NO]     its exact value (float16)
    v        uint8   [P, D/2]    uniform 4-bit codes
    v_scale  float16 [P, D/G]    per (token, group of G channels)
    v_zero   float16 [P, D/G]

    one page, one KV head (P = 16, D = 128, NO = 1, G = 32):
    k     |t0: c0|c1 c2|c3 ... c126|c127|   ... 16 rows x 64 B
    k_scale/k_zero   |s0 s1 ... s127|  |z0 ... z127|      2 x 256 B
    k_oidx |i_t0 ... i_t15|  16 B      k_oval |x_t0 ... x_t15|  32 B
    v     |t0: 64 B| ... 16 rows       v_scale/v_zero |t0: g0..g3| ...  2 x 128 B

Bytes per token per KV head (``bytes_per_token_expr``), D = 128, P = 16:
K codes 64 + K scale/zero 32 (4*D per page over 16 tokens) + outliers 3
(1 index + 2 value bytes) + V codes 64 + V scale/zero 16 = **179**, against
176 for KIVI int4 (and 512 for fp16). ``D`` must be one of ``head_dims``
(indices are uint8, so D <= 256).
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import os
from typing import TYPE_CHECKING

from kvgen.plugin_api import (FP16_LIMIT, KvgenError, PageTensor, Scheme, half_toward_zero, lazy_import,
                              split_nonfinite)
from kvgen_nuq.codebook import (CodebookError, channel_range, check_codebook, encode, level_midpoints, load_codebooks,
                                normalize, outliers_per_token, split_outliers)

if TYPE_CHECKING:
    import sympy
    import torch
else:
    # kvgen imports this module to register nuq4 for every command: registering, planning and compiling read
    # only the layout and the codebook floats. torch loads on the first quantize/dequantize, sympy when
    # bytes_per_token_expr is asked for.
    torch = lazy_import("torch")

VALUE_GROUP = 32
CODEBOOK_ENV = "KVGEN_NUQ_CODEBOOK"
"""Environment variable naming a codebook file to use instead of the shipped one."""
DEFAULT_CODEBOOK = "stories260K.json"


def value_group(head_dim: int) -> int:
    """Channels per value scale group: the largest power of two <= 32 dividing ``head_dim``."""
    return math.gcd(VALUE_GROUP, head_dim)


@functools.lru_cache(maxsize=1)
def _sympy_functions() -> tuple[type, type]:
    """``(nuq_value_group, nuq_outliers)``: sympy functions for bytes-per-token expressions, defined on first
    use so that sympy loads only then. Exact for every D: neither is linear in D."""
    import sympy

    class nuq_value_group(sympy.Function):
        """``gcd(32, D)``."""

        @classmethod
        def eval(cls, d):
            if d.is_Integer:
                return sympy.Integer(value_group(int(d)))
            return None

    class nuq_outliers(sympy.Function):
        """``max(1, D // 100)``: outliers per token."""

        @classmethod
        def eval(cls, d):
            if d.is_Integer:
                return sympy.Integer(outliers_per_token(int(d)))
            return None

    return nuq_value_group, nuq_outliers


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` codes 0..15 -> ``[..., D/2]`` uint8, channel 2j in the low nibble of byte j."""
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack4`: int64 codes ``[..., D]``."""
    b = packed.to(torch.int64)
    return torch.stack([b & 15, b >> 4], -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x with NaN/Inf set to 0 and clamped to +-FP16_LIMIT, x * 0)``; the macros do the same.

    ``FP16_LIMIT`` (:data:`kvgen.plugin_api.FP16_LIMIT`, KIVI's limit too): with inputs within it and
    the key scale capped so that ``|level| * scale + |zero|`` stays within it, every dequantized value
    is finite in float16 (scales, zeros and outliers are float16), roundings included. ``x * 0`` summed
    over a group is the marker that turns the group's stored scale (or outlier) NaN."""
    x, zeros = split_nonfinite(x)
    return x.clamp(-FP16_LIMIT, FP16_LIMIT), zeros


def quantize_values(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform asymmetric 4-bit codes of float32 ``v`` ``[..., D]`` per group of ``group`` channels:
    ``(codes int64 [..., D], scale fp16 [..., D/group], zero fp16 [..., D/group])``.

    Inputs are clamped to +-``FP16_LIMIT``; a group holding a NaN or an Inf gets scale NaN (its
    codes and zero those of the group with the non-finite entries set to 0)."""
    g, zeros = _finite(v.reshape(*v.shape[:-1], v.shape[-1] // group, group))
    bad = zeros.sum(-1, keepdim=True)
    mn = g.amin(-1, keepdim=True)
    scale = ((g.amax(-1, keepdim=True) - mn) / 15.0).to(torch.float16)
    zero = mn.to(torch.float16)
    s, z = scale.float(), zero.float()
    ok = s > 0
    # floor(y + 0.5), not torch.round: the kernel rounds half up, and codes must match bit for bit.
    code = torch.floor((g - z) / torch.where(ok, s, torch.ones_like(s)) + 0.5).clamp_(0, 15)
    code = torch.where(ok, code, torch.zeros_like(code)).long()
    return code.reshape(v.shape), (scale + bad.to(torch.float16)).squeeze(-1), zero.squeeze(-1)


def codebook_path(spec: str | None = None):
    """The codebook file for ``spec``: a path, or the name of a shipped file (``smollm2-135m``,
    ``stories260K.json``). ``spec`` None: ``$KVGEN_NUQ_CODEBOOK`` (the same forms; kept for backward
    compatibility), else the shipped default. Shipped files are Traversables, paths strings."""
    shipped = importlib.resources.files("kvgen_nuq") / "codebooks"
    if spec is None:
        spec = os.environ.get(CODEBOOK_ENV) or None
    if not spec:
        return shipped / DEFAULT_CODEBOOK
    if "/" not in spec and os.sep not in spec and not os.path.exists(spec):
        name = spec if spec.endswith(".json") else f"{spec}.json"
        if (shipped / name).is_file():
            return shipped / name
    return spec


def shipped_codebooks() -> list[str]:
    """Names of the codebook files shipped in the package (without ``.json``)."""
    folder = importlib.resources.files("kvgen_nuq") / "codebooks"
    return sorted(e.name.removesuffix(".json") for e in folder.iterdir() if e.name.endswith(".json"))


def _file_stamp(path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns if isinstance(path, str) else None
    except OSError:
        return None


@functools.lru_cache(maxsize=16)
def _read(path: str, shipped: bool, stamp: int | None) -> tuple[dict[int, tuple[float, ...]], str]:
    # ``stamp`` (a file's mtime) only keys the cache, so a refitted file is read again.
    data = load_codebooks(importlib.resources.files("kvgen_nuq") / "codebooks" / path if shipped else path)
    source = f"kvgen_nuq/codebooks/{path}" if shipped else path
    books = {p: tuple(float(c) for c in b["pooled"]) for p, b in data["codebooks"].items()}
    return books, f"{source} (pooled, {data.get('model', '?')}, {data.get('keys', '?')} keys)"


def read_codebooks(spec: str | None = None) -> tuple[dict[int, tuple[float, ...]], str]:
    """``({page_size: levels}, description)`` of the pooled codebooks in the file ``spec`` selects
    (see :func:`codebook_path`); CodebookError if it cannot be read or holds no valid codebook."""
    if spec is not None and not spec.strip():
        raise CodebookError(f"nuq4 option codebook is empty; give a codebook file or one of "
                            f"{', '.join(shipped_codebooks())} (nuq4:codebook=NAME)")
    path = codebook_path(spec)
    if spec is not None and isinstance(path, str) and not os.path.exists(path):
        raise CodebookError(f"nuq4 codebook {spec!r}: no such file, nor a shipped codebook "
                            f"({', '.join(shipped_codebooks())}); pass a file written by 'kvgen nuq calibrate'")
    if isinstance(path, str):
        return _read(path, False, _file_stamp(path))
    return _read(path.name, True, None)


def default_codebooks() -> tuple[dict[int, tuple[float, ...]], str]:
    """``({page_size: levels}, description)`` of the pooled codebooks nuq4 uses without the ``codebook``
    option: ``$KVGEN_NUQ_CODEBOOK`` if set, else the shipped default."""
    return read_codebooks(None)


class Nuq4(Scheme):
    """nuq4: codebook keys per channel over the page + per-token fp16 outliers; KIVI-style 4-bit values."""

    name = "nuq4"
    bits = 4
    summary = ("non-uniform 4-bit: keys per channel over each page through a k-means codebook, top 1% per token "
               "kept fp16; values per token in groups of 32; partial tail page in fp")
    macro_template = "nuq4.j2"
    residual_tokens = 0
    head_dims = (8, 64, 80, 96, 128, 256)
    page_sizes = (8, 16, 32, 64, 128)
    tolerance = 2e-3
    # Measured: attention over a cache of random normal K/V (8 KV heads, GQA 4, D 128, 1024 tokens,
    # page 16, 64 causal queries) vs float32, relative L2: nuq4 0.099, KIVI int4 0.102 (same method).
    expected_error = 0.099

    options = {
        "codebook": ("codebook file: a path to a file written by 'kvgen nuq calibrate', or the name of a shipped "
                     "one (stories260K, smollm2-135m); default $KVGEN_NUQ_CODEBOOK, else stories260K"),
    }

    def __init__(self, codebooks=None, source: str | None = None):
        """``codebooks``: ``{page_size: 16 levels}`` (or one list of levels for every page size);
        default: the pooled codebooks of :func:`default_codebooks`."""
        if codebooks is None:
            codebooks, source = default_codebooks()
        if not isinstance(codebooks, dict):
            codebooks = {p: codebooks for p in type(self).page_sizes}
        # Levels stay tuples of floats (planning and compiling read only them); codebook() builds the tensor.
        self.codebooks = {int(p): check_codebook(cb, f"scheme {self.name}, page {p}") for p, cb in sorted(codebooks.items())}
        self._tensors: dict[int, torch.Tensor] = {}
        self.codebook_source = source or "given"
        # The page sizes this instance can serve are those it has a codebook for.
        self.page_sizes = tuple(p for p in type(self).page_sizes if p in self.codebooks)
        if not self.page_sizes:
            raise CodebookError(f"scheme {self.name}: no codebook for any page size in {list(type(self).page_sizes)} "
                                f"(have {sorted(self.codebooks)}); refit with 'kvgen nuq calibrate'")

    def configure(self, codebook: str) -> "Nuq4":
        """A new instance on the pooled codebooks of ``codebook`` (``--kv nuq4:codebook=F``)."""
        return type(self)(*read_codebooks(codebook))

    def codebook(self, page_size: int) -> torch.Tensor:
        """The 16 float32 levels used for pages of ``page_size`` tokens, as a CPU tensor (built once, then cached;
        callers must not modify it)."""
        cached = self._tensors.get(page_size)
        if cached is not None:
            return cached
        try:
            levels = self.codebooks[page_size]
        except KeyError:
            raise KvgenError(f"scheme {self.name} has no codebook for page size {page_size} "
                             f"(has {sorted(self.codebooks)}); pass --page-size or refit with 'kvgen nuq calibrate'") from None
        return self._tensors.setdefault(page_size, torch.tensor(levels, dtype=torch.float32))

    # -- layout -----------------------------------------------------------
    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        if head_dim % 2 or head_dim > 256:
            raise KvgenError(f"scheme {self.name}: head_dim must be even and at most 256, got {head_dim}; pick another --kv")
        g = value_group(head_dim)
        no = outliers_per_token(head_dim)
        return (
            PageTensor("k", "uint8", (page_size, head_dim // 2)),
            PageTensor("k_scale", "float16", (head_dim,)),
            PageTensor("k_zero", "float16", (head_dim,)),
            PageTensor("k_oidx", "uint8", (page_size, no)),
            PageTensor("k_oval", "float16", (page_size, no)),
            PageTensor("v", "uint8", (page_size, head_dim // 2)),
            PageTensor("v_scale", "float16", (page_size, head_dim // g)),
            PageTensor("v_zero", "float16", (page_size, head_dim // g)),
        )

    def bytes_per_token_expr(self) -> sympy.Expr:
        # Exact for every D: the outlier count and value group are not linear in D.
        from kvgen.plugin_api import D, P  # sympy symbols: sympy loads here, never for planning

        nuq_value_group, nuq_outliers = _sympy_functions()
        codes = 2 * D / 2                        # K and V, 4 bits each
        k_meta = 2 * 2 * D / P                   # k_scale + k_zero per page
        outliers = 3 * nuq_outliers(D)           # uint8 index + float16 value
        v_meta = 2 * 2 * D / nuq_value_group(D)  # v_scale + v_zero per token group
        return codes + k_meta + outliers + v_meta

    # -- reference ---------------------------------------------------------
    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        h, page, d = k.shape
        # Non-finite keys: the token's first outlier value becomes NaN, so that token reads back NaN.
        k, zeros = _finite(k.float())
        no = outliers_per_token(d)
        oidx, oval, mask = split_outliers(k, no)
        oval = oval.to(torch.float16)
        oval[..., 0] += zeros.sum(-1).to(torch.float16)
        scale, zero = channel_range(k, mask)
        cb = self.codebook(page)
        # every dequantized key, level * scale + zero, stays within FP16_LIMIT (levels may pass +-1)
        cap = ((FP16_LIMIT - zero.float().abs()) / cb.abs().max()).clamp(max=65504.0)
        scale = torch.minimum(scale, half_toward_zero(cap))
        x = normalize(k, scale, zero)
        codes = torch.where(scale.unsqueeze(-2) > 0, encode(x, cb), 0)
        vc, vs, vz = quantize_values(v.float(), value_group(d))
        return {
            "k": pack4(codes),
            "k_scale": scale,
            "k_zero": zero,
            "k_oidx": oidx.to(torch.uint8),
            "k_oval": oval,
            "v": pack4(vc),
            "v_scale": vs,
            "v_zero": vz,
        }

    def dequantize_page(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = unpack4(tensors["k"])                                   # [H, P, D]
        cb = self.codebook(codes.shape[-2]).to(codes.device)
        k = cb[codes] * tensors["k_scale"].float().unsqueeze(-2) + tensors["k_zero"].float().unsqueeze(-2)
        k = k.scatter(-1, tensors["k_oidx"].long(), tensors["k_oval"].float())
        g = value_group(head_dim)
        vc = unpack4(tensors["v"]).float()
        h, page, _ = vc.shape
        vc = vc.reshape(h, page, head_dim // g, g)
        v = vc * tensors["v_scale"].float()[..., None] + tensors["v_zero"].float()[..., None]
        return k, v.reshape(h, page, head_dim)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Page-by-page roundtrip of ``[H, T, D]``; ``page_size`` None treats all T tokens as one page."""
        h, n, d = k.shape
        page = page_size or n
        if n % page:
            raise ValueError(f"{n} tokens is not a whole number of {page}-token pages")
        out = [self.dequantize_page(self.quantize_page(k[:, i:i + page], v[:, i:i + page]), d)
               for i in range(0, n, page)]
        return torch.cat([a for a, _ in out], 1), torch.cat([b for _, b in out], 1)

    def params(self):
        return {
            **super().params(),
            # JSON object keys are strings; the macros index them with L.PAGE | string.
            "codebooks": {str(p): [float(c) for c in cb] for p, cb in self.codebooks.items()},
            "thresholds": {str(p): list(level_midpoints(cb)) for p, cb in self.codebooks.items()},
            "codebook_source": self.codebook_source,
            "key_group": "page",
            "key_outliers": "max(1, D // 100) per token, fp16",
            "value_group": VALUE_GROUP,
        }
