"""The scheme contract: what a KV compression scheme must declare and provide.

This is public API for plugin authors. A scheme is one object (an instance of
a :class:`Scheme` subclass) registered through the ``kvgen_register_schemes``
hook. The planner asks it for bytes per token; codegen asks it for its page
tensors and its Jinja macros; the kernel tests use its torch reference
``quantize_page`` / ``dequantize_page`` as the oracle.

Page storage
------------
For every layer, a *compressed pool* holds one tensor per :class:`PageTensor`
the scheme declares, allocated as ``[num_pages, num_kv_heads, *shape]`` and
contiguous, so the data of one page of one KV head is one contiguous block
starting at element ``(page * num_kv_heads + kv_head) * prod(shape)``.

Residual pages
--------------
``residual_tokens`` says how a sequence's most recent tokens are kept:

- ``None``: there is no residual; every token is quantized and stored in the
  compressed pool the moment it is written (per-token schemes such as int8).
- ``R >= 0``: the sequence's last, partly filled page *and* its
  ``R // page_size`` most recent full pages stay in a *residual pool* in the
  compute dtype (tensors ``k`` and ``v``, ``[num_pages, H, page, D]``). A full
  page older than that is converted with the scheme's ``quantize_page``
  macro into a compressed page. So a sequence of ``n`` tokens has
  ``compressed_pages(n)`` compressed pages first, then residual pages.

Options
-------
A scheme may accept options, given wherever a user names a scheme as
``NAME:key=value[:key=value...]`` (``kvgen plan/compile --kv``, each item of
``kvgen eval --kv``, ``attach(model, scheme=...)``). :func:`resolve_scheme`
is the one parser; it looks the name up and calls ``with_options``. A scheme
declares what it accepts in the class attribute ``options`` (option name ->
one-line description of the value) and implements ``configure(**values)``,
which returns a *new* instance (registered schemes are shared objects and are
never mutated). ``with_options`` refuses undeclared names, calls
``configure`` and records the values on the new instance
(``option_values``, all strings); ``params()`` then carries them, so plans,
kernel specs and compile caches differ whenever an option does.

Jinja macros
------------
``macro_template`` names a template (found on the template search path, see
the ``kvgen_register_templates`` hook) defining these macros; every one
receives ``L``, the rendering context (see ``kvgen.codegen.render``), and
emits Triton statements at the current indentation:

A decode/prefill tile holds ``BLOCK_N`` tokens that may span several pages
(the tile size is a tunable), so the attention macros take per-token vectors:
``base`` (int64 ``[BLOCK_N]``, the element index ``page * H + kv_head`` of
each token's page), ``offs_t`` (int32 ``[BLOCK_N]``, each token's slot in its
page) and ``mask_t`` (bool ``[BLOCK_N]``, False past the sequence end).

- ``scores(out, q, base, offs_t, offs_d, mask_t, L)``: ``out`` =
  ``q @ Kᵀ`` as float32 ``[BLOCK_G, BLOCK_N]``, where ``q`` is a float32
  ``[BLOCK_G, BLOCK_D]`` tile (already scaled by the softmax scale).
- ``accumulate(acc, p, base, offs_t, offs_d, mask_t, L)``: ``acc +=
  p @ V`` with ``p`` float32 ``[BLOCK_G, BLOCK_N]`` (zero where masked) and
  ``acc`` float32 ``[BLOCK_G, BLOCK_D]``.
- ``load_page(k, v, base, offs_t, offs_d, mask_t, L)``: dequantized float32
  tiles ``[BLOCK_N, BLOCK_D]`` (masked tokens and padded lanes read 0).
- ``store_tokens(k, v, base, offs_t, offs_d, mask_t, L)``: quantize and
  store a tile of tokens, one per row (``k``, ``v`` float32
  ``[BLOCK_T, BLOCK_D]``, padded lanes are zero; ``base``, ``offs_t`` and
  ``mask_t`` ``[BLOCK_T]``: row i goes to slot ``offs_t[i]`` of page
  ``base[i]`` when ``mask_t[i]``). The constexpr ``NATIVE_FP8`` is in
  scope (hardware float8 conversion available). Only for schemes with
  ``residual_tokens is None``.
- ``store_page(k, v, base, offs_t, offs_d, L)``: quantize and store a whole
  page (``k``, ``v`` float32 ``[PAGE, BLOCK_D]``, ``base`` a scalar,
  ``offs_t = tl.arange(0, PAGE)``). Only for schemes with a residual.

Page-aligned tiles (optional fast path; backward compatible): a caller
whose tiles are whole pages -- every tile starts at a page boundary, token i
of the tile is slot ``i % PAGE`` of the tile's page ``i // PAGE``, and
``BLOCK_N = PAGES * PAGE`` -- imports the macro template *with context* and
defines the Jinja variable ``page_tile``, a dict of names: ``pages`` (a
constexpr, the pages per tile), ``pbase`` (int64 ``[pages]``, the element
index ``page * H + kv_head`` of each tile page, so ``base`` is ``pbase``
with every entry repeated PAGE times) and ``pmask`` (bool ``[pages]``, False
for pages past the range being read; a masked page's tokens are all masked).
``mask_t`` keeps its meaning (a token of a True page may still be masked).
The decode template guarantees this; prefill does not (it imports without
context). Macros may test ``page_tile is defined`` and then load per-page
metadata once per page as ``[pages, ...]`` and broadcast it over the page's
tokens through a ``[pages, PAGE, ...]`` view; otherwise they must use only
the per-token vectors.

Macros may define helper variables; they must prefix them with the name of
their output argument (``out``/``acc``/``k``) so two expansions never clash.
Pointers are named ``<tensor name>_ptr`` (``k_ptr``, ``k_scale_ptr``...);
``L.t[name].stride`` is the per-(page, head) element stride of that tensor
as a folded constant. Padded lanes (``offs_d >= head_dim``) must read as
zero and never be stored.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from kvgen.errors import SchemeCapabilityError, SchemeOptionError, UnknownSchemeError

if TYPE_CHECKING:  # torch and sympy load on first use: listing, planning and the CLI's --help never need torch
    import sympy
    import torch

COMPUTE = "compute"
"""A PageTensor dtype meaning: the compute dtype of the plan (fp16/bf16/fp32)."""

DTYPE_BYTES = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4, "int64": 8, "float64": 8,
}
"""Bytes per element of the torch dtype names page tensors use, without importing torch."""


def dtype_bytes(dtype_name: str) -> int:
    """Bytes per element of the torch dtype ``dtype_name`` (asks torch only for names not in :data:`DTYPE_BYTES`)."""
    if dtype_name in DTYPE_BYTES:
        return DTYPE_BYTES[dtype_name]
    import torch

    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


@functools.lru_cache(maxsize=1)
def symbols() -> tuple["sympy.Symbol", "sympy.Symbol"]:
    """The (D, P) sympy symbols of bytes-per-token expressions (head dim, page size); see :data:`D`, :data:`P`."""
    import sympy

    return (sympy.Symbol("D", positive=True, integer=True), sympy.Symbol("P", positive=True, integer=True))


def __getattr__(name: str) -> Any:
    # ``from kvgen.schemes import D, P`` keeps working; sympy loads only then.
    if name in ("D", "P"):
        return symbols()["DP".index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class PageTensor:
    """One tensor of a compressed page: ``[num_pages, num_kv_heads, *shape]``.

    ``dtype`` is a torch dtype name (``"int8"``, ``"uint8"``, ``"float16"``,
    ``"float32"``, ``"float8_e4m3fn"``...) or :data:`COMPUTE`.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]

    def elements(self) -> int:
        return math.prod(self.shape)

    def torch_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        import torch

        return compute_dtype if self.dtype == COMPUTE else getattr(torch, self.dtype)

    def nbytes_per_page_head(self, compute_dtype: torch.dtype) -> int:
        if self.dtype == COMPUTE:
            return self.elements() * compute_dtype.itemsize
        return self.elements() * dtype_bytes(self.dtype)


class Scheme:
    """Base class of every KV compression scheme.

    Subclasses set the class attributes and implement ``page_tensors``,
    ``quantize_page`` and ``dequantize_page``. ``bytes_per_token_expr``
    defaults to the sum of the page tensors' bytes divided by the page size,
    which is exact for any layout that declares all its storage.
    """

    name: ClassVar[str]
    bits: ClassVar[int]
    summary: ClassVar[str] = ""
    macro_template: ClassVar[str]
    residual_tokens: ClassVar[int | None] = None
    head_dims: ClassVar[tuple[int, ...] | None] = None
    """Head dims the kernels support; None means any (padded to a power of two)."""
    page_sizes: ClassVar[tuple[int, ...]] = (8, 16, 32, 64, 128)
    min_arch: ClassVar[int] = 0
    """Lowest CUDA compute capability (major*10+minor) the kernels need; 0 = any."""
    tolerance: ClassVar[float] = 2e-3
    """Kernel-vs-reference relative L2 error the shared test matrix allows."""
    expected_error: ClassVar[float | None] = None
    """Typical relative L2 error of attention over this cache vs float32 (random
    normal data); the planner's ``--kv auto`` prefers the smallest. None means
    unknown: ranked as 2**-bits."""
    options: ClassVar[Mapping[str, str]] = {}
    """Options the scheme accepts (``--kv name:key=value``): option name -> one-line description
    of its value (say its type and default). Empty: the scheme takes none."""
    option_values: Mapping[str, str] = {}
    """The options this instance was configured with (set by ``with_options``; read-only)."""

    # -- options ----------------------------------------------------------
    def with_options(self, **values: Any) -> "Scheme":
        """A new instance of this scheme configured with ``values`` (option name -> value).

        Never mutates ``self`` (registered schemes are shared). Names the
        scheme does not declare in ``options`` raise SchemeOptionError; values
        are passed to ``configure`` as strings (as the command line gives
        them), merged over the options ``self`` already has. No values:
        returns ``self``. Override ``configure``, not this method.
        """
        unknown = sorted(set(values) - set(self.options))
        if unknown:
            have = (f"its options are {', '.join(sorted(self.options))}" if self.options
                    else "it takes no options")
            raise SchemeOptionError(f"scheme {self.name} has no option {', '.join(map(repr, unknown))}; "
                                    f"{have} (kvgen schemes --json lists them)")
        if not values:
            return self
        merged = dict(sorted({**self.option_values, **{k: str(v) for k, v in values.items()}}.items()))
        new = self.configure(**merged)
        if new is self or not isinstance(new, Scheme) or new.name != self.name:
            raise TypeError(f"scheme {self.name}: configure() must return a new {type(self).__name__}, not {new!r}")
        new.option_values = merged
        return new

    def configure(self, **values: str) -> "Scheme":
        """Build a new instance for the (declared, string) option ``values``; raise a KvgenError for a bad value.

        Called by ``with_options`` only; ``values`` holds every option set so
        far (a chained ``with_options`` passes the merged values). Must not
        modify ``self`` -- return e.g. ``copy.copy(self)`` with instance
        attributes set, or a freshly constructed instance.
        """
        raise NotImplementedError(
            f"scheme {self.name} declares options {sorted(self.options)} but does not implement configure()")

    @property
    def label(self) -> str:
        """The name plus its options, as :func:`resolve_scheme` accepts it: ``nuq4:codebook=x.json``."""
        return self.name + "".join(f":{k}={v}" for k, v in sorted(self.option_values.items()))

    # -- layout -----------------------------------------------------------
    def page_tensors(self, head_dim: int, page_size: int) -> tuple[PageTensor, ...]:
        raise NotImplementedError(f"scheme {self.name} must declare its page tensors")

    def bytes_per_token_per_kv_head(self, head_dim: int, page_size: int) -> float:
        """K and V bytes one token costs per KV head in the compressed pool (:meth:`page_bytes_per_token`)."""
        return float(self.page_bytes_per_token(head_dim, page_size))

    def page_bytes_per_token(self, head_dim: int, page_size: int) -> Fraction:
        """Exact K and V bytes per token per KV head in the compressed pool: the page tensors' bytes over the page size.

        This is what the runtime allocates (one tensor per PageTensor), so it
        is the planner's number; it needs no sympy. :meth:`bytes_per_token_expr`
        is the same quantity as a formula in D and P (the shared scheme tests
        check that they agree).
        """
        return Fraction(self._page_bytes(head_dim, page_size), page_size)

    def _page_bytes(self, head_dim: int, page_size: int) -> int:
        return sum(t.elements() * dtype_bytes(self._concrete_dtype(t)) for t in self.page_tensors(head_dim, page_size))

    def bytes_per_token_expr(self) -> sympy.Expr:
        """Bytes per token per KV head as a sympy expression in :data:`D` and :data:`P`.

        Built only when asked for (planning uses :meth:`page_bytes_per_token`,
        so it never imports sympy). The default samples ``page_tensors`` and is
        exact for layouts whose sizes are linear in D and in D*P (true of every
        built-in scheme); override it for anything else. It must equal
        :meth:`page_bytes_per_token` at every supported (D, P).
        """
        import sympy

        D, P = symbols()
        total = self._page_bytes

        # Fit a*D + b*D/P (+ c + e/P) from four samples on a 2x2 grid.
        d0, d1, p0, p1 = 64, 128, 16, 32
        a11, a12, a21, a22 = total(d0, p0), total(d0, p1), total(d1, p0), total(d1, p1)
        # bytes per page = alpha*D*P + beta*D + gamma*P + delta
        alpha = sympy.Rational((a22 - a21 - a12 + a11), (d1 - d0) * (p1 - p0))
        beta = sympy.Rational(a21 - a11, d1 - d0) - alpha * p0
        gamma = sympy.Rational(a12 - a11, p1 - p0) - alpha * d0
        delta = a11 - alpha * d0 * p0 - beta * d0 - gamma * p0
        # expand, not simplify: the same sum of terms, without simplify's 0.5 s (it imports sympy.physics).
        return sympy.expand((alpha * D * P + beta * D + gamma * P + delta) / P)

    def _concrete_dtype(self, t: PageTensor) -> str:
        if t.dtype == COMPUTE:
            raise SchemeCapabilityError(f"scheme {self.name}: compressed tensors must have a concrete dtype")
        return t.dtype

    # -- reference (the oracle) --------------------------------------------
    def quantize_page(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize one page for every KV head.

        ``k``, ``v``: ``[H, page_size, head_dim]`` floating point. Returns one
        tensor per page tensor, shaped ``[H, *shape]``, exactly as the kernels
        store them. Per-token schemes must quantize each token independently
        (so a partly written page quantizes the same as a full one).
        """
        raise NotImplementedError(f"scheme {self.name} must implement quantize_page")

    def dequantize_page(self, tensors: dict[str, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of ``quantize_page``: float32 ``k``, ``v`` of ``[H, page_size, head_dim]``."""
        raise NotImplementedError(f"scheme {self.name} must implement dequantize_page")

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize(quantize(k, v)) page by page; ``k``, ``v``: ``[H, tokens, D]``, tokens a multiple of the page size."""
        head_dim = k.shape[-1]
        return self.dequantize_page(self.quantize_page(k, v), head_dim)

    # -- capabilities -------------------------------------------------------
    def check(self, head_dim: int, page_size: int, arch: int | None = None) -> None:
        """Raise SchemeCapabilityError unless this scheme supports the shape and arch."""
        if self.head_dims is not None and head_dim not in self.head_dims:
            raise SchemeCapabilityError(
                f"scheme {self.name} does not support head_dim {head_dim} (supported: {list(self.head_dims)}); pick another --kv")
        self.check_page_size(page_size)
        if arch is not None and arch and arch < self.min_arch:
            raise SchemeCapabilityError(
                f"scheme {self.name} needs compute capability {self.min_arch / 10:.1f}+, the target has {arch / 10:.1f}; pick another --kv")

    def check_page_size(self, page_size: int) -> None:
        """Raise SchemeCapabilityError unless pages of ``page_size`` tokens suit this scheme (declared, and whole residual pages)."""
        if page_size not in self.page_sizes:
            raise SchemeCapabilityError(
                f"scheme {self.name} does not support page size {page_size} (supported: {list(self.page_sizes)}); pass --page-size")
        if self.residual_tokens and self.residual_tokens % page_size:
            raise SchemeCapabilityError(
                f"scheme {self.name} keeps {self.residual_tokens} residual tokens, not a whole number of {page_size}-token pages; pass another --page-size")

    def residual_pages(self, page_size: int) -> int:
        """Full pages a sequence keeps in the compute dtype (besides its partial tail page)."""
        return 0 if self.residual_tokens is None else self.residual_tokens // page_size

    def compressed_pages(self, num_tokens: int, page_size: int) -> int:
        """How many of a sequence's first pages are in the compressed pool."""
        pages = -(-num_tokens // page_size)
        if self.residual_tokens is None:
            return pages
        return max(0, num_tokens // page_size - self.residual_pages(page_size))

    def precision_rank(self) -> float:
        """Lower is more precise; orders schemes for ``--kv auto``."""
        return self.expected_error if self.expected_error is not None else 2.0 ** -self.bits

    def params(self) -> dict[str, Any]:
        """The scheme's parameters as JSON-able data (goes into plan.json and every KernelSpec).

        A configured instance's option values are included (``options``), so
        two configurations never share a kernel cache entry; subclasses add
        whatever their kernels bake in (the values an option selects).
        """
        out = {"bits": self.bits, "residual_tokens": self.residual_tokens}
        if self.option_values:
            out["options"] = dict(self.option_values)
        return out

    def describe(self, head_dim: int = 128, page_size: int = 16) -> dict[str, Any]:
        return {
            "name": self.name,
            "bits": self.bits,
            "summary": self.summary,
            "bytes_per_token_per_kv_head": self.bytes_per_token_per_kv_head(head_dim, page_size),
            "residual_tokens": self.residual_tokens,
            "head_dims": list(self.head_dims) if self.head_dims else "any",
            "page_sizes": list(self.page_sizes),
            "min_arch": self.min_arch,
            "options": dict(self.options),
        }


OPTION_SEP = ":"
"""Separates a scheme's name from its options and the options from each other (``nuq4:codebook=f.json``)."""


def parse_scheme_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"NAME[:key=value[:key=value...]]"`` -> ``(NAME, {key: value})``; SchemeOptionError if malformed.

    The separator is ``:`` (a ``,`` would clash with ``kvgen eval --kv a,b``);
    a value runs to the next ``:`` and may contain ``=``. Keys must not repeat.
    """
    name, *items = str(text).strip().split(OPTION_SEP)
    name = name.strip()
    if not name:
        raise SchemeOptionError(
            f"--kv {text!r}: no scheme name; write NAME or NAME:key=value (kvgen schemes lists them)")
    values: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key or not key.isidentifier():
            raise SchemeOptionError(f"--kv {text!r}: bad option {item!r}; write {name}:key=value[:key=value...]")
        if key in values:
            raise SchemeOptionError(f"--kv {text!r}: option {key!r} given twice")
        values[key] = value.strip()
    return name, values


def resolve_scheme(text: str, schemes: Mapping[str, Scheme]) -> Scheme:
    """The scheme ``text`` names, configured with its options (``"int4"``, ``"nuq4:codebook=f.json"``).

    The one resolver every entry point uses (planner ``--kv``, ``kvgen eval
    --kv`` items, ``attach(scheme=...)``, codegen re-reading a plan). Returns
    the registered object itself when no option is given, else a new
    instance from its ``with_options``. Raises UnknownSchemeError or
    SchemeOptionError (one-line messages).
    """
    name, values = parse_scheme_spec(text)
    if name not in schemes:
        raise unknown_scheme_error(name, schemes)
    return schemes[name].with_options(**values)


def unknown_scheme_error(name: str, schemes: Mapping[str, Scheme]) -> UnknownSchemeError:
    """The error for a scheme name ``schemes`` lacks: one line, saying which plugin failed (or was left out)
    when the registry knows (``schemes.missing_reason``, see :class:`kvgen.registry.SchemeTable`)."""
    known = f"known: {', '.join(sorted(schemes))} (kvgen schemes lists them)"
    reason = getattr(schemes, "missing_reason", None)
    why = reason(name) if reason is not None else None
    return UnknownSchemeError(f"{why}; {known}" if why else f"unknown --kv scheme {name!r}; {known}")


D: "sympy.Symbol"
"""Head dim symbol used in bytes-per-token expressions (created on first use, see :func:`symbols`)."""
P: "sympy.Symbol"
"""Page size symbol used in bytes-per-token expressions (created on first use, see :func:`symbols`)."""
