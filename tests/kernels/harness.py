"""Reusable helpers for the kernel tests (decode, prefill, cache ops, any scheme).

What a kernel test needs, independent of the op:

- :func:`device` -- the device tests run on (``KVGEN_TEST_DEVICE``, default ``cpu``:
  the Triton interpreter, see ``tests/conftest.py``).
- :func:`make_cache` -- a paged cache of random sequences for one scheme, pools
  poisoned with NaN / garbage first, pages in random physical order, filled
  through the scheme's torch reference; it also returns the K/V the kernels
  should see (dequantized compressed pages, residual pages in the compute
  dtype) and the raw float K/V.
- ``rel_l2`` (from ``reference.py``, beside ``reference_attention``: float64
  causal attention by position, GQA, sliding window, softcap), :func:`poisoned_like`.
- :func:`scheme_matrix`, :func:`kernel_specs` -- the test parametrization, built
  from every registered scheme's capability declarations (head dims, page
  sizes, residual window, min arch), so a scheme added later is covered with
  no test written for it.
- :func:`load_op` -- render and import one op's kernel module for a case.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import pytest
import torch

from kvgen.codegen.loader import load_kernel
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import default_registry
from kvgen.runtime.pools import allocate_pool, poison_
from kvgen.schemes import Scheme

from .reference import rel_l2

# --------------------------------------------------------------------------- devices


def device() -> str:
    """The device CPU-or-GPU tests run on: ``KVGEN_TEST_DEVICE`` (default ``cpu``)."""
    return os.environ.get("KVGEN_TEST_DEVICE", "cpu")


default_device = device


def on_cpu(dev: str | torch.device | None = None) -> bool:
    return torch.device(dev or device()).type == "cpu"


def device_arch(dev: str | torch.device | None = None) -> int:
    """Compute capability as major*10+minor of a CUDA device; 0 for the CPU."""
    dev = torch.device(dev or device())
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 0  # the CPU, or a CUDA test collected on a machine without one (it skips at run time)
    major, minor = torch.cuda.get_device_capability(dev)
    return major * 10 + minor


def arch_name(dev: str | torch.device | None = None) -> str:
    arch = device_arch(dev)
    return f"sm_{arch}" if arch else "cpu"


def require_cuda() -> None:
    """Skip the calling test unless a CUDA device is usable (for ``@pytest.mark.gpu`` tests)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set; run GPU tests with KVGEN_TEST_DEVICE=cuda")


def compute_dtypes(dev: str | torch.device | None = None) -> tuple[torch.dtype, ...]:
    """Compute dtypes worth testing on ``dev`` (never bfloat16 in the interpreter)."""
    return (torch.float32, torch.float16) if on_cpu(dev) else (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


# --------------------------------------------------------------------------- schemes


def get_scheme(scheme: Scheme | str) -> Scheme:
    return default_registry().schemes[scheme] if isinstance(scheme, str) else scheme


def all_schemes() -> list[Scheme]:
    return [default_registry().schemes[n] for n in sorted(default_registry().schemes)]


def skip_reason(scheme: Scheme, dev: str | torch.device | None = None) -> str | None:
    """Why ``scheme`` cannot run on ``dev``, or None when it can."""
    if on_cpu(dev):
        if scheme.min_arch > 0:
            return f"{scheme.name} needs sm_{scheme.min_arch}+ (no interpreter path)"
        if any(t.dtype == "bfloat16" for t in scheme.page_tensors(64, 16)):
            return f"{scheme.name} stores bfloat16, unreliable in the Triton interpreter"
        return None
    arch = device_arch(dev)
    if arch and arch < scheme.min_arch:
        return f"{scheme.name} needs sm_{scheme.min_arch}+, device is sm_{arch}"
    return None


def scheme_matrix(dev: str | torch.device | None = None) -> list[Any]:
    """One ``pytest.param(scheme_name)`` per registered scheme; those that cannot run on ``dev`` are skip-marked."""
    params = []
    for s in all_schemes():
        reason = skip_reason(s, dev)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(s.name, marks=marks, id=s.name))
    return params


def supported(scheme: Scheme, axis: str, values: Iterable[int]) -> tuple[int, ...]:
    """``values`` of ``axis`` (``head_dim`` or ``page_size``) the scheme declares; its own if none match."""
    values = tuple(values)
    if axis == "head_dim":
        ok = [v for v in values if scheme.head_dims is None or v in scheme.head_dims]
        fallback = tuple(scheme.head_dims or ())
    elif axis == "page_size":
        def fits(p: int) -> bool:
            return p in scheme.page_sizes and not (scheme.residual_tokens and scheme.residual_tokens % p)
        ok = [v for v in values if fits(v)]
        fallback = tuple(p for p in scheme.page_sizes if fits(p))
    else:
        return values
    return tuple(ok) if ok else fallback[:1]


def residual_window(scheme: Scheme) -> int:
    return scheme.residual_tokens or 0


LENGTH_KINDS = ("1", "page-1", "page", "page+1", "window+page+1", "ragged")


def lengths_for(kind: str, scheme: Scheme, page: int) -> list[int]:
    """Sequence lengths of one batch for a length kind of the matrix.

    Non-residual schemes use ``3*page + 1`` for ``window+page+1`` (several pages,
    a partial tail). ``ragged`` mixes every other kind in one batch.
    """
    window = residual_window(scheme)
    single = {
        "1": 1, "page-1": max(1, page - 1), "page": page, "page+1": page + 1,
        "window+page+1": window + page + 1 if window else 3 * page + 1,
    }
    if kind == "ragged":
        return [single[k] for k in ("window+page+1", "1", "page+1", "page-1", "page")] + [window + 2 * page + 3]
    return [single[kind], single[kind]]


@dataclass(frozen=True)
class Case:
    """One kernel test case: a scheme and the axis values of its KernelSpec (plus extras such as lengths)."""

    scheme: str
    head_dim: int
    gqa: int
    page_size: int
    compute_dtype: str
    num_kv_heads: int = 2
    extra: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.extra).get(key, default)

    @property
    def dtype(self) -> torch.dtype:
        return as_dtype(self.compute_dtype)

    @property
    def scheme_obj(self) -> Scheme:
        return get_scheme(self.scheme)

    def spec(self, op: str, dev: str | torch.device | None = None, **kw: Any) -> KernelSpec:
        return kernel_spec(op, self.scheme, self.head_dim, self.num_kv_heads, self.gqa, self.page_size,
                           self.compute_dtype, dev=dev, **kw)

    def id(self) -> str:
        extra = "-".join(f"{v}" for _, v in self.extra)
        return f"{self.scheme}-d{self.head_dim}-g{self.gqa}-p{self.page_size}-{self.compute_dtype}" + (f"-{extra}" if extra else "")


def gpu_case(scheme: str) -> Case:
    """The GPU tests' real-size case: a Llama-3-70B shard (64 query / 8 KV heads), D=128, page 16, bfloat16.

    Falls back to the scheme's first supported head dim / page size where it declares others.
    """
    s = get_scheme(scheme)
    d = supported(s, "head_dim", (128,))[0]
    p = supported(s, "page_size", (16,))[0]
    return Case(scheme=scheme, head_dim=d, gqa=8, page_size=p, compute_dtype="bfloat16", num_kv_heads=8)


def _rotating(axes: dict[str, Sequence[Any]], n: int | None = None) -> list[dict[str, Any]]:
    """A cut of the product that takes every value of every axis at least once.

    Case ``i`` takes value ``(i + (i // len) * (j + 1)) % len`` of the ``j``-th axis:
    the first ``len`` cases of an axis sweep it in order, and each wrap shifts the
    axes against each other so later cases pair values differently.
    """
    n = n or max(len(v) for v in axes.values())
    out = []
    for i in range(n):
        case = {}
        for j, (name, values) in enumerate(axes.items()):
            k = len(values)
            case[name] = values[(i + (i // k) * (j + 1)) % k]
        if case not in out:
            out.append(case)
    return out


def kernel_specs(axes: dict[str, Sequence[Any]] | None = None, *, full: bool = False, rotations: int = 1,
                 dev: str | torch.device | None = None, num_kv_heads: int = 2,
                 schemes: Iterable[str] | None = None) -> list[Any]:
    """The test matrix as ``pytest.param(Case)``: every registered scheme x the axes.

    ``axes`` may hold ``head_dim``, ``gqa``, ``page_size``, ``compute_dtype`` and
    any extra axis (its values land in ``Case.extra``). Each scheme only gets the
    head dims and page sizes it declares. ``full=True`` is the whole product;
    otherwise a rotating cut of ``rotations * max(len(axis))`` cases per scheme
    that still takes every value of every axis at least once. Schemes that
    cannot run on ``dev`` appear once, skip-marked.
    """
    axes = dict(axes or {})
    axes.setdefault("head_dim", (64,))
    axes.setdefault("gqa", (4,))
    axes.setdefault("page_size", (16,))
    axes.setdefault("compute_dtype", tuple(dtype_name(d) for d in compute_dtypes(dev)))
    core = ("head_dim", "gqa", "page_size", "compute_dtype")
    params = []
    names = list(schemes) if schemes is not None else [s.name for s in all_schemes()]
    for name in names:
        s = get_scheme(name)
        reason = skip_reason(s, dev)
        if reason:
            params.append(pytest.param(None, marks=pytest.mark.skip(reason=reason), id=f"{name}-skipped"))
            continue
        sa = {k: supported(s, k, v) for k, v in axes.items()}
        sa = {k: tuple(dict.fromkeys(v)) for k, v in sa.items()}
        if full:
            combos = [dict(zip(sa, vals)) for vals in itertools.product(*sa.values())]
        else:
            combos = _rotating(sa, rotations * max(len(v) for v in sa.values()))
        for c in combos:
            case = Case(scheme=name, head_dim=c["head_dim"], gqa=c["gqa"], page_size=c["page_size"],
                        compute_dtype=dtype_name(c["compute_dtype"]), num_kv_heads=num_kv_heads,
                        extra=tuple((k, v) for k, v in c.items() if k not in core))
            params.append(pytest.param(case, id=case.id()))
    return params


def kernel_spec(op: str, scheme: Scheme | str, head_dim: int, num_kv_heads: int, gqa: int, page_size: int,
                compute_dtype: torch.dtype | str, dev: str | torch.device | None = None, **kw: Any) -> KernelSpec:
    """The KernelSpec of one op for a test case (arch from the device)."""
    return KernelSpec(op=op, scheme=get_scheme(scheme).name, head_dim=head_dim, num_kv_heads=num_kv_heads,
                      gqa_group=gqa, page_size=page_size, compute_dtype=dtype_name(compute_dtype),
                      arch=arch_name(dev), **kw)


def load_op(op: str, scheme: Scheme | str, head_dim: int, num_kv_heads: int, gqa: int, page_size: int,
            compute_dtype: torch.dtype | str, dev: str | torch.device | None = None, **kw: Any):
    """Render and import the kernel module of one op (exposes ``launch``)."""
    spec = kernel_spec(op, scheme, head_dim, num_kv_heads, gqa, page_size, compute_dtype, dev=dev, **kw)
    return load_kernel(spec, get_scheme(scheme))


# --------------------------------------------------------------------------- caches


@dataclass
class Cache:
    """A paged cache of ``B`` random sequences for one scheme, and what the kernels should see.

    ``ks[b]``/``vs[b]``: float32 ``[H, seq_lens[b], D]`` as the kernels see them
    (compressed pages dequantized by the reference, residual pages rounded to the
    compute dtype); ``ks_raw``/``vs_raw``: the float32 data before any rounding.
    ``pages[b]``: the physical page id of each logical page (compressed-pool ids
    first, then residual-pool ids). ``spare_pages``/``spare_residual_pages``: pool
    pages no sequence uses (poisoned; the block tables' unused entries point there).
    """

    scheme: Scheme
    head_dim: int
    num_kv_heads: int
    page_size: int
    compute_dtype: torch.dtype
    device: str
    pools: dict[str, torch.Tensor]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_compressed: torch.Tensor
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    ks_raw: list[torch.Tensor]
    vs_raw: list[torch.Tensor]
    pages: list[list[int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    compressed_counts: list[int] = field(default_factory=list)
    spare_pages: list[int] = field(default_factory=list)
    spare_residual_pages: list[int] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def residual(self) -> bool:
        return self.scheme.residual_tokens is not None

    def compressed_pool(self) -> dict[str, torch.Tensor]:
        return {n: self.pools[n] for n in self.tensor_names()}

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.scheme.page_tensors(self.head_dim, self.page_size)]


def pool_descriptions(scheme: Scheme, head_dim: int, page_size: int) -> list[dict[str, Any]]:
    """The compressed pool's tensors as the plain dicts ``allocate_pool`` takes."""
    return [{"name": t.name, "dtype": t.dtype, "shape": t.shape} for t in scheme.page_tensors(head_dim, page_size)]


def residual_descriptions(head_dim: int, page_size: int) -> list[dict[str, Any]]:
    return [{"name": "rk", "dtype": "compute", "shape": (page_size, head_dim)},
            {"name": "rv", "dtype": "compute", "shape": (page_size, head_dim)}]


def make_cache(scheme: Scheme | str, head_dim: int, num_kv_heads: int, page_size: int, seq_lens: Sequence[int],
               compute_dtype: torch.dtype | str, device: str | None = None, seed: int = 0,
               spare: int = 2, scale: float = 1.0) -> Cache:
    """Build a poisoned, randomly paged cache holding random normal K/V per sequence.

    Compressed pages are written through ``scheme.quantize_page`` (a partial last
    page is padded with NaN, so its unwritten slots stay poison for per-token
    schemes), residual pages through a cast to the compute dtype. Every pool
    starts poisoned (NaN / garbage bytes), physical page ids are a random
    permutation with ``spare`` extra poisoned pages per pool, and unused block
    table entries point at a spare page.
    """
    scheme = get_scheme(scheme)
    dtype = as_dtype(compute_dtype)
    dev = device or default_device()
    P, H, D = page_size, num_kv_heads, head_dim
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in seq_lens]
    n_pages = [-(-n // P) for n in lengths]
    n_comp = [scheme.compressed_pages(n, P) for n in lengths]
    residual = scheme.residual_tokens is not None
    total_c = sum(n_comp)
    total_r = sum(n_pages) - total_c
    num_c_pool = total_c + spare
    num_r_pool = total_r + spare if residual else 0

    pools = allocate_pool(pool_descriptions(scheme, D, P), num_c_pool, H, dtype, "cpu", poison=True)
    if residual:
        pools.update(allocate_pool(residual_descriptions(D, P), num_r_pool, H, dtype, "cpu", poison=True))
    c_ids = torch.randperm(num_c_pool, generator=gen).tolist()
    r_ids = torch.randperm(num_r_pool, generator=gen).tolist() if residual else []
    spare_c, c_ids = c_ids[total_c:], c_ids[:total_c]
    spare_r, r_ids = r_ids[total_r:], r_ids[:total_r]

    width = max([1, *n_pages])
    fill = spare_c[0] if spare_c else 0
    block_tables = torch.full((len(lengths), width), fill, dtype=torch.int32)
    ks, vs, ks_raw, vs_raw, pages = [], [], [], [], []
    for b, n in enumerate(lengths):
        k_raw = torch.randn(H, n, D, generator=gen) * scale
        v_raw = torch.randn(H, n, D, generator=gen) * scale
        k_seen = torch.empty(H, n, D)
        v_seen = torch.empty(H, n, D)
        ids = []
        for j in range(n_pages[b]):
            lo, hi = j * P, min((j + 1) * P, n)
            if j < n_comp[b]:
                pid = c_ids.pop()
                kp = torch.full((H, P, D), float("nan"))
                vp = torch.full((H, P, D), float("nan"))
                kp[:, : hi - lo] = k_raw[:, lo:hi]
                vp[:, : hi - lo] = v_raw[:, lo:hi]
                tensors = scheme.quantize_page(kp, vp)
                for name, t in tensors.items():
                    pools[name][pid] = t.to(pools[name].dtype)
                kd, vd = scheme.dequantize_page({n_: pools[n_][pid].clone() for n_ in tensors}, D)
                k_seen[:, lo:hi] = kd[:, : hi - lo].float()
                v_seen[:, lo:hi] = vd[:, : hi - lo].float()
            else:
                pid = r_ids.pop()
                pools["rk"][pid, :, : hi - lo] = k_raw[:, lo:hi].to(dtype)
                pools["rv"][pid, :, : hi - lo] = v_raw[:, lo:hi].to(dtype)
                k_seen[:, lo:hi] = k_raw[:, lo:hi].to(dtype).float()
                v_seen[:, lo:hi] = v_raw[:, lo:hi].to(dtype).float()
            block_tables[b, j] = pid
            ids.append(pid)
        ks.append(k_seen)
        vs.append(v_seen)
        ks_raw.append(k_raw)
        vs_raw.append(v_raw)
        pages.append(ids)

    return Cache(
        scheme=scheme, head_dim=D, num_kv_heads=H, page_size=P, compute_dtype=dtype, device=dev,
        pools={k: v.to(dev) for k, v in pools.items()},
        block_tables=block_tables.to(dev),
        seq_lens=torch.tensor(lengths, dtype=torch.int32).to(dev),
        num_compressed=torch.tensor(n_comp, dtype=torch.int32).to(dev),
        ks=ks, vs=vs, ks_raw=ks_raw, vs_raw=vs_raw, pages=pages, lengths=lengths,
        compressed_counts=n_comp, spare_pages=spare_c, spare_residual_pages=spare_r)


# --------------------------------------------------------------------------- references
# reference_attention and rel_l2 live in tests/kernels/reference.py (pure math, no kernel or layout)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` full of poison (NaN for floats), for kernel outputs."""
    return poison_(torch.empty_like(t))


def random_q(batch: int, num_heads: int, head_dim: int, dtype: torch.dtype, dev: str, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype).to(dev)


def tolerance(scheme: Scheme, compute_dtype: torch.dtype) -> float:
    """The scheme's kernel-vs-reference tolerance; bfloat16 rounding of q and p needs at least 1e-2."""
    tol = scheme.tolerance
    return max(tol, 1e-2) if compute_dtype == torch.bfloat16 else tol


def cache_and_kernel(op: str, case, lengths, *, seed: int = 0, window: int = 0, softcap: float = 0.0, dev=None):
    """A random paged cache for ``lengths`` and the ``op`` kernel for ``case`` (window/softcap in its spec)."""
    dev = dev or device()
    s = case.scheme_obj
    cache = make_cache(s, case.head_dim, case.num_kv_heads, case.page_size, lengths, case.dtype, device=dev, seed=seed)
    kw = {}
    if window:
        kw["sliding_window"] = window
    if softcap:
        kw["softcap"] = softcap
    mod = load_op(op, s, case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype, dev=dev, **kw)
    return cache, mod


def check(case: Case, out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """A kernel output against its reference: no NaN (poisoned slots and unwritten rows stay NaN), rel L2 within the scheme's tolerance."""
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a row left unwritten or a poisoned slot leaked)"
    err = rel_l2(out, ref)
    tol = tolerance(case.scheme_obj, case.dtype)
    assert err <= tol, f"{what}: rel L2 {err:.2e} > {tol:.1e}"


def case_lengths(case: Case) -> list[int]:
    """The sequence lengths of a matrix case (its ``lengths`` axis, resolved for its scheme and page size)."""
    return lengths_for(case.get("lengths"), case.scheme_obj, case.page_size)

