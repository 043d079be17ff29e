"""Paged prefill/append kernel (templates/triton/prefill.j2) vs each scheme's reference.

Every registered scheme (picked up from the registry and its capability
declarations, no per-scheme code) is run through the generated prefill
kernel and compared with float64 attention over the scheme's *dequantized*
K/V, within ``scheme.tolerance`` (relative L2).

Axes: head_dim {8, 64, 96, 128} x GQA {1, 4, 8} x page {16, 32} x sequence
lengths {1, page-1, page, page+1, residual window + page + 1, ragged batch}
x query chunk {whole sequence (prefill), short chunk at the end (append
after a prefix-cache hit)}. The full product is ``slow``; the default cut
(``test_prefill_ci``) covers every axis value at least once per scheme.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch

from kvgen.codegen.loader import load_kernel
from kvgen.codegen.spec import KernelSpec
from kvgen.registry import default_registry

DEVICE = os.environ.get("KVGEN_TEST_DEVICE", "cpu")
HEAD_DIMS = (8, 64, 96, 128)
GQAS = (1, 4, 8)
PAGES = (16, 32)
LENGTH_KINDS = ("one", "page-1", "page", "page+1", "window+page+1", "ragged")
CHUNKS = ("prefill", "append")
NUM_KV_HEADS = 2


# --------------------------------------------------------------------------
# Cache builder (local; tests/kernels/harness.py replaces it once it exists)
# --------------------------------------------------------------------------

@dataclass
class Cache:
    pools: dict
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_compressed: torch.Tensor
    ks: list          # per sequence float32 [H, seq_len, D], what the kernel must see
    vs: list


def make_cache(scheme, head_dim, num_kv_heads, page_size, seq_lens, compute_dtype, device, seed) -> Cache:
    """Random K/V written page by page through the scheme's reference quantizer, pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    H, D, P = num_kv_heads, head_dim, page_size
    tensors = scheme.page_tensors(D, P)
    pages = [-(-n // P) for n in seq_lens]
    ncomp = [scheme.compressed_pages(n, P) for n in seq_lens]
    n_c, n_r = sum(ncomp) + 1, sum(p - c for p, c in zip(pages, ncomp)) + 1
    pools = {}
    for t in tensors:
        dt = t.torch_dtype(compute_dtype)
        pools[t.name] = torch.zeros((n_c, H, *t.shape), dtype=dt)
    residual = scheme.residual_tokens is not None
    if residual:
        # Unwritten residual slots hold NaN: the kernel must never read them.
        pools["rk"] = torch.full((n_r, H, P, D), float("nan"), dtype=compute_dtype)
        pools["rv"] = torch.full((n_r, H, P, D), float("nan"), dtype=compute_dtype)
    cperm = torch.randperm(n_c, generator=g).tolist()
    rperm = torch.randperm(n_r, generator=g).tolist()
    max_pages = max(pages) + 1
    # Entries past a sequence's pages point far outside every pool: never dereferenced.
    bt = torch.full((len(seq_lens), max_pages), 2**30, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        k = torch.randn(H, pages[b] * P, D, generator=g)
        v = torch.randn(H, pages[b] * P, D, generator=g)
        k[:, n:] = 0.0
        v[:, n:] = 0.0
        kref, vref = torch.zeros_like(k), torch.zeros_like(v)
        for i in range(pages[b]):
            sl = slice(i * P, (i + 1) * P)
            if i < ncomp[b]:
                pid = cperm.pop()
                q = scheme.quantize_page(k[:, sl], v[:, sl])
                for name, val in q.items():
                    pools[name][pid] = val.to(pools[name].dtype)
                dk, dv = scheme.dequantize_page({n_: pools[n_][pid] for n_ in q}, D)
                kref[:, sl], vref[:, sl] = dk.float(), dv.float()
            else:
                pid = rperm.pop()
                m = min(P, n - i * P)
                pools["rk"][pid, :, :m] = k[:, i * P:i * P + m].to(compute_dtype)
                pools["rv"][pid, :, :m] = v[:, i * P:i * P + m].to(compute_dtype)
                kref[:, sl] = k[:, sl].to(compute_dtype).float()
                vref[:, sl] = v[:, sl].to(compute_dtype).float()
            bt[b, i] = pid
        ks.append(kref[:, :n])
        vs.append(vref[:, :n])
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    return Cache(pools={k_: t.to(device) for k_, t in pools.items()}, block_tables=bt.to(device),
                 seq_lens=as_i32(list(seq_lens)), num_compressed=as_i32(ncomp), ks=ks, vs=vs)


def reference_attention(q, ks, vs, q_positions, window=0, softcap=0.0, sm_scale=None):
    """float64 causal attention of one sequence: q [n, Hq, D] at absolute q_positions over ks/vs [H, L, D]."""
    n, hq, d = q.shape
    h = ks.shape[0]
    dev = q.device
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    t = torch.arange(ks.shape[1], device=dev)[None, :]
    pos = torch.as_tensor(q_positions, device=dev)[:, None]
    ok = t <= pos
    if window:
        ok &= t > pos - window
    out = torch.empty(n, hq, d, dtype=torch.float64, device=dev)
    for head in range(hq):   # one head at a time: [n, L] float64 stays small at real sizes
        k = ks[head // (hq // h)].to(dev, torch.float64)
        v = vs[head // (hq // h)].to(dev, torch.float64)
        s = (q[:, head].double() @ k.T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~ok, float("-inf"))
        out[:, head] = torch.softmax(s, -1) @ v
    return out


def rel_l2(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------

def _schemes():
    return dict(sorted(default_registry().schemes.items()))


def _compute_dtype(scheme):
    # bf16 is unreliable in the interpreter: on CPU bf16 pages are read into a float32 computation.
    if DEVICE == "cpu":
        return torch.float32 if scheme.name in ("fp32", "bf16") else torch.float16
    return torch.bfloat16


def _lengths(kind, page, scheme):
    window = scheme.residual_tokens or 2 * page
    return {
        "one": [1],
        "page-1": [page - 1],
        "page": [page],
        "page+1": [page + 1],
        "window+page+1": [window + page + 1],
        "ragged": [page + 1, 1, window + page + 1, 2 * page - 1, page],
    }[kind]


def _qlens(seq_lens, chunk, page):
    """Whole sequence (prefill) or a short tail chunk (append); ragged batches mix both, and a 0."""
    if chunk == "prefill":
        return list(seq_lens)
    short = [min(n, max(1, page // 4 + 1)) for n in seq_lens]
    if len(seq_lens) > 2:
        short[1] = 0          # a sequence with no new tokens this step
        short[-1] = seq_lens[-1]
    return short


def run_case(scheme, head_dim, gqa, page, seq_lens, qlens, *, window=0, softcap=0.0, config=None,
             compute_dtype=None, num_kv_heads=NUM_KV_HEADS, seed=0, tolerance=None):
    if page not in scheme.page_sizes or (scheme.head_dims and head_dim not in scheme.head_dims) \
            or (scheme.residual_tokens and scheme.residual_tokens % page):
        pytest.skip(f"{scheme.name} does not declare head_dim {head_dim} / page {page}")
    dtype = compute_dtype or _compute_dtype(scheme)
    dname = str(dtype).replace("torch.", "")
    spec = KernelSpec(op="prefill", scheme=scheme.name, head_dim=head_dim, num_kv_heads=num_kv_heads,
                      gqa_group=gqa, page_size=page, compute_dtype=dname,
                      arch="cpu" if DEVICE == "cpu" else "sm_90", sliding_window=window, softcap=softcap)
    mod = load_kernel(spec, scheme, default_registry())
    cache = make_cache(scheme, head_dim, num_kv_heads, page, seq_lens, dtype, DEVICE, seed)
    hq = num_kv_heads * gqa
    g = torch.Generator().manual_seed(seed + 1)
    total_q = sum(qlens)
    q = torch.randn(total_q, hq, head_dim, generator=g).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))          # poisoned: every valid element must be written
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEVICE)
    sm_scale = 1.0 / math.sqrt(head_dim)
    mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed,
               cu, max(qlens), sm_scale, config=config)
    refs = []
    for b, (n, ql) in enumerate(zip(seq_lens, qlens)):
        if ql == 0:
            continue
        qb = q[cu[b]:cu[b] + ql].float()
        refs.append(reference_attention(qb, cache.ks[b], cache.vs[b], list(range(n - ql, n)),
                                        window=window, softcap=softcap, sm_scale=sm_scale))
    ref = torch.cat(refs)
    assert not torch.isnan(out).any(), "kernel left output elements unwritten (or produced NaN)"
    err = rel_l2(out, ref)
    tol = tolerance if tolerance is not None else scheme.tolerance
    assert err <= tol, f"{spec.name}: rel L2 {err:.3g} > {tol:.3g} (lens {seq_lens}, qlens {qlens})"
    return err


def _scheme_params(full=False):
    out = []
    for name, s in _schemes().items():
        marks = []
        if s.min_arch > 0 and DEVICE == "cpu":
            marks.append(pytest.mark.skip(reason=f"{name} needs sm_{s.min_arch}, not the CPU interpreter"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _small_tiles(page, gqa):
    """Smallest legal tiles: many query blocks and KV tiles even on short sequences."""
    gp = 1 << (gqa - 1).bit_length()
    return {"BLOCK_M": max(1, 16 // gp), "PAGES_PER_TILE": max(1, 16 // page), "num_warps": 4, "num_stages": 1}


def _ci_cases():
    """Each length kind once per scheme, cycling the other axes so each of their values appears too."""
    cases = []
    for i, kind in enumerate(LENGTH_KINDS):
        head_dim = HEAD_DIMS[i % len(HEAD_DIMS)]
        gqa = GQAS[i % len(GQAS)]
        page = PAGES[i % len(PAGES)]
        chunk = CHUNKS[(i // 2) % len(CHUNKS)] if kind != "ragged" else "append"
        small = kind in ("window+page+1", "ragged")
        cases.append((kind, head_dim, gqa, page, chunk, small))
    # the covering set above leaves 'prefill' on the long sequence to this one
    cases.append(("window+page+1", 128, 4, 16, "prefill", False))
    return cases


@pytest.mark.parametrize("kind,head_dim,gqa,page,chunk,small", _ci_cases(),
                         ids=[f"{k}-d{d}-g{g}-p{p}-{c}{'-small' if s else ''}" for k, d, g, p, c, s in _ci_cases()])
@pytest.mark.parametrize("scheme_name", _scheme_params())
def test_prefill_ci(scheme_name, kind, head_dim, gqa, page, chunk, small):
    scheme = _schemes()[scheme_name]
    seq_lens = _lengths(kind, page, scheme)
    run_case(scheme, head_dim, gqa, page, seq_lens, _qlens(seq_lens, chunk, page),
             config=_small_tiles(page, gqa) if small else None, seed=zlib.crc32(f"{kind}{head_dim}{gqa}{page}".encode()) % 1000)


@pytest.mark.parametrize("window,softcap", [(7, 0.0), (0, 5.0), (20, 3.0)], ids=["window7", "softcap5", "window20-softcap3"])
@pytest.mark.parametrize("scheme_name", _scheme_params())
def test_prefill_window_softcap(scheme_name, window, softcap):
    scheme = _schemes()[scheme_name]
    page = 16
    seq_lens = _lengths("ragged", page, scheme)
    run_case(scheme, 64, 4, page, seq_lens, _qlens(seq_lens, "append", page), window=window, softcap=softcap,
             config=_small_tiles(page, 4))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("kind", LENGTH_KINDS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("gqa", GQAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scheme_name", _scheme_params(full=True))
def test_prefill_full(scheme_name, head_dim, gqa, page, kind, chunk):
    scheme = _schemes()[scheme_name]
    seq_lens = _lengths(kind, page, scheme)
    run_case(scheme, head_dim, gqa, page, seq_lens, _qlens(seq_lens, chunk, page), seed=head_dim + gqa + page)


# --------------------------------------------------------------------------
# GPU: real size, bfloat16 (run with -m gpu and KVGEN_TEST_DEVICE=cuda)
# --------------------------------------------------------------------------

BF16_FLOOR = 1e-2   # bf16 output rounding alone is ~1e-3 rel L2; P and K/V in bf16 add a few more


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("scheme_name", _scheme_params())
def test_prefill_gpu_bf16(scheme_name, chunk):
    if DEVICE == "cpu" or not torch.cuda.is_available():
        pytest.skip("needs KVGEN_TEST_DEVICE=cuda and a CUDA device")
    scheme = _schemes()[scheme_name]
    major, minor = torch.cuda.get_device_capability()
    if scheme.min_arch > major * 10 + minor:
        pytest.skip(f"{scheme_name} needs sm_{scheme.min_arch}")
    seq_lens = [4096]
    qlens = [4096] if chunk == "prefill" else [256]
    run_case(scheme, 128, 8, 16, seq_lens, qlens, compute_dtype=torch.bfloat16, num_kv_heads=8,
             tolerance=max(scheme.tolerance, BF16_FLOOR))
