"""Paged prefill/append kernel (templates/triton/prefill.j2) vs each scheme's reference.

Every registered scheme is picked up from its capability declarations
(``harness.kernel_specs``; no per-scheme code here) and run through the
generated prefill kernel: a chunk of query tokens per sequence (varlen,
``cu_seqlens_q``) that are the sequence's last cached tokens, attending
causally to its whole cache. The output (poisoned with NaN before the
launch) is compared with float64 attention over the scheme's *dequantized*
K/V within ``scheme.tolerance`` (relative L2). Pools start poisoned, so a
kernel that reads an unwritten slot fails.

Two key sources (the ``kv`` axis): ``pages`` -- every key read back from the
pages (launch without k_new/v_new); ``fresh`` -- the chunk's own keys passed
as k_new/v_new in the compute dtype and attended exactly, only the cached
prefix read from the pages (what ``KVCache.prefill(layer, q, k, v)`` does).
The fresh reference is therefore [dequantized prefix ; exact chunk], and the
pages that hold only chunk tokens (and the chunk's residual slots) are
poisoned before a fresh launch, so reading the chunk back from the pages
fails with NaN.

Axes: head_dim {8, 64, 96, 128} x GQA {1, 4, 8} x page {16, 32} x sequence
lengths {1, page-1, page, page+1, residual window + page + 1, ragged batch}
x query chunk {whole sequence (plain prefill), short chunk at the end (append
after a prefix-cache hit)} x key source {pages, fresh} x compute dtype. The
whole product is ``slow``; the default cut covers every value of every axis
at least once per scheme, plus tile configs, sliding window, softcap, fresh
chunks at page boundaries and edge cases.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from . import harness as hz
from .reference import reference_attention

HEAD_DIMS = (8, 64, 96, 128)
GQAS = (1, 4, 8)
PAGES = (16, 32)
CHUNKS = ("prefill", "append")
SOURCES = ("pages", "fresh")
AXES = {"head_dim": HEAD_DIMS, "gqa": GQAS, "page_size": PAGES, "lengths": hz.LENGTH_KINDS, "chunk": CHUNKS,
        "kv": SOURCES}


# --------------------------------------------------------------------------- helpers


def chunk_lens(lengths: list[int], chunk: str, page: int) -> list[int]:
    """Query tokens per sequence: the whole sequence, or a short chunk at its end.

    Append chunks vary per sequence (a few tokens, one crossing a page
    boundary, a single token); in a batch of more than two, one sequence
    brings no new token (qlen 0) and the last one is a whole prefill, as a
    chunked-prefill scheduler mixes them.
    """
    if chunk == "prefill":
        return list(lengths)
    pattern = (page // 4 + 1, page + 3, 1)
    out = [min(n, pattern[i % len(pattern)]) for i, n in enumerate(lengths)]
    if len(lengths) > 2:
        out[1] = 0
        out[-1] = lengths[-1]
    return out


def small_tiles(case: hz.Case) -> dict:
    """Small tiles (32 rows, 32 KV tokens): several query blocks and KV tiles on short sequences."""
    gp = 1 << (case.gqa - 1).bit_length()
    return {"block_m": max(1, 32 // gp), "pages_per_tile": max(1, 32 // case.page_size),
            "num_warps": 4, "num_stages": 1}


def fresh_kv(cache: hz.Cache, qlens, strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' own K/V as a caller holds them: ``[total_q, H, D]`` in the compute dtype, q's row order.

    ``strided``: views into wider buffers (no unit head stride), as launch accepts any strides.
    """
    def rows(xs):
        x = torch.cat([t[:, n - ql:].transpose(0, 1) for t, n, ql in zip(xs, cache.lengths, qlens)])
        x = x.to(cache.compute_dtype).to(cache.device)
        if not strided:
            return x.contiguous()
        wide = hz.poison_(torch.empty(x.shape[0], x.shape[1], 2 * x.shape[2], dtype=x.dtype, device=x.device))
        wide[..., 1::2] = x
        return wide[..., 1::2]
    return rows(cache.ks_raw), rows(cache.vs_raw)


def fresh_seen(cache: hz.Cache, qlens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a fresh launch attends per sequence: the dequantized prefix from the pages, then the exact chunk."""
    dt = cache.compute_dtype

    def join(seen, raw):
        return [torch.cat([s[:, :n - ql], r[:, n - ql:].to(dt).float()], 1)
                for s, r, n, ql in zip(seen, raw, cache.lengths, qlens)]
    return join(cache.ks, cache.ks_raw), join(cache.vs, cache.vs_raw)


def poison_chunks(cache: hz.Cache, qlens) -> None:
    """Poison what a fresh launch must not read: pages holding only chunk tokens, and chunk slots of residual pages.

    (A compressed page shared by prefix and chunk stays: the prefix needs it, and a
    packed page cannot be poisoned slot by slot.)
    """
    P = cache.page_size
    for b, (n, ql) in enumerate(zip(cache.lengths, qlens)):
        first = n - ql
        for j, pid in enumerate(cache.pages[b]):
            lo, hi = j * P, min((j + 1) * P, n)
            if hi <= first:
                continue
            if j < cache.compressed_counts[b]:
                if lo >= first:
                    for name in cache.tensor_names():
                        hz.poison_(cache.pools[name][pid])
            else:
                for name in ("rk", "rv"):
                    hz.poison_(cache.pools[name][pid, :, max(first, lo) - lo:])


def prepare_prefill(case: hz.Case, lengths, qlens, *, seed=0, window=0, softcap=0.0, q_scale=1.0, dev=None, q=None,
                    fresh=False, strided=False):
    """Build a cache (deterministic in ``seed``) and queries; return ``(launch, reference_fn)``.

    ``launch(config=None)`` runs the prefill kernel into a fresh poisoned output and
    returns it; ``reference_fn(window=..., softcap=...)`` is float64 attention over
    what the kernel must attend. ``fresh``: pass the chunks' exact K/V as
    k_new/v_new (``strided``: as strided views) after poisoning the pages only the
    chunks use; the reference then attends [dequantized prefix ; exact chunk].
    One preparation serves many launches: at real sizes the cache build and the
    reference cost far more than a kernel.
    """
    dev = dev or hz.device()
    cache, mod = hz.cache_and_kernel("prefill", case, lengths, seed=seed, window=window, softcap=softcap, dev=dev)
    hq = case.num_kv_heads * case.gqa
    if q is None:
        q = hz.random_q(sum(qlens), hq, case.head_dim, torch.float32, "cpu", seed=seed + 1) * q_scale
        q = q.to(case.dtype).to(dev)
    kw, ks, vs = {}, cache.ks, cache.vs
    if fresh:
        kw["k_new"], kw["v_new"] = fresh_kv(cache, qlens, strided)
        ks, vs = fresh_seen(cache, qlens)
        poison_chunks(cache, qlens)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32).to(dev)
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    positions = [list(range(n - ql, n)) for n, ql in zip(lengths, qlens)]

    def launch(config=None):
        out = hz.poisoned_like(q)
        mod.launch(q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, cu,
                   max([0, *qlens]), sm_scale, config=config, **kw)
        return out

    def reference_fn(window=0, softcap=0.0):
        return _reference(q, ks, vs, positions, window, softcap, sm_scale)

    return launch, reference_fn


def run_prefill(case: hz.Case, lengths, qlens, *, config=None, seed=0, window=0, softcap=0.0, q_scale=1.0,
                dev=None, q=None, fresh=False, strided=False):
    """One launch on a fresh cache (see prepare_prefill): returns (out, reference float64, reference_fn)."""
    launch, reference_fn = prepare_prefill(case, lengths, qlens, seed=seed, window=window, softcap=softcap,
                                              q_scale=q_scale, dev=dev, q=q, fresh=fresh, strided=strided)
    out = launch(config)
    return out, reference_fn(window, softcap), reference_fn


def _reference(q, ks, vs, positions, window, softcap, sm_scale):
    # One KV head's query group at a time: the float64 logits stay small at real sizes.
    H = ks[0].shape[0]
    G = q.shape[1] // H
    parts = []
    for h in range(H):
        parts.append(reference_attention(q[:, h * G:(h + 1) * G], [k[h:h + 1] for k in ks],
                                         [v[h:h + 1] for v in vs], positions, window=window,
                                         softcap=softcap, sm_scale=sm_scale))
    return torch.cat(parts, dim=1)




def _one_case(scheme: str, head_dim=64, gqa=4, page=16, dtype=None, num_kv_heads=2) -> hz.Case:
    s = hz.get_scheme(scheme)
    head_dim = hz.supported(s, "head_dim", (head_dim,))[0]
    page = hz.supported(s, "page_size", (page,))[0]
    dtype = dtype or hz.compute_dtypes()[-1]
    return hz.Case(scheme=scheme, head_dim=head_dim, gqa=gqa, page_size=page, compute_dtype=hz.dtype_name(dtype),
                   num_kv_heads=num_kv_heads)


def _long_lengths(case: hz.Case) -> list[int]:
    """A ragged batch whose longest sequence spans many tiles, past the residual window."""
    P, w = case.page_size, hz.residual_window(case.scheme_obj)
    return [w + 5 * P + 5, 3, w + 2 * P, w + 3 * P - 1]


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("case", hz.kernel_specs({**AXES, "tiles": ("default", "small")}, rotations=2))
def test_prefill_matrix(case):
    lengths = hz.case_lengths(case)
    qlens = chunk_lens(lengths, case.get("chunk"), case.page_size)
    config = small_tiles(case) if case.get("tiles") == "small" else None
    out, ref, _ = run_prefill(case, lengths, qlens, config=config, seed=case.head_dim + case.gqa,
                              fresh=case.get("kv") == "fresh")
    hz.check(case, out, ref, f"lengths {lengths}, qlens {qlens}, kv {case.get('kv')}")


@pytest.mark.slow
@pytest.mark.parametrize("case", hz.kernel_specs(AXES, full=True))
def test_prefill_matrix_full(case):
    lengths = hz.case_lengths(case)
    qlens = chunk_lens(lengths, case.get("chunk"), case.page_size)
    out, ref, _ = run_prefill(case, lengths, qlens, seed=case.head_dim + case.gqa + case.page_size,
                              fresh=case.get("kv") == "fresh")
    hz.check(case, out, ref, f"lengths {lengths}, qlens {qlens}, kv {case.get('kv')}")


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("block_m,ppt", [(8, 1), (16, 2), (32, 4)])
def test_prefill_tiles(scheme, block_m, ppt):
    """Many query blocks x KV tiles spanning several pages, ragged chunk lengths, one config each."""
    case = _one_case(scheme, head_dim=96, gqa=2, page=16, dtype=torch.float32 if hz.on_cpu() else None,
                     num_kv_heads=1)
    lengths = _long_lengths(case)
    qlens = [lengths[0], 0, 2 * case.page_size + 1, 5]
    out, ref, _ = run_prefill(case, lengths, qlens, config={"block_m": block_m, "pages_per_tile": ppt}, seed=3)
    hz.check(case, out, ref, f"block_m {block_m}, {ppt} pages per tile")


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_prefill_append_matches_prefill(scheme):
    """An appended chunk's rows equal the same rows of a whole-sequence prefill (same cache, same q)."""
    case = _one_case(scheme, gqa=2, num_kv_heads=1)
    lengths = _long_lengths(case)
    hq = case.num_kv_heads * case.gqa
    q_full = hz.random_q(sum(lengths), hq, case.head_dim, case.dtype, hz.device(), seed=22)
    out_full, ref_full, _ = run_prefill(case, lengths, lengths, q=q_full, seed=21)
    hz.check(case, out_full, ref_full, "whole prefill")
    # the same query rows, appended: the last tail[b] rows of each sequence
    tail = [7, 2, 1, case.page_size + 1]
    ends = list(itertools.accumulate(lengths))
    rows = torch.cat([torch.arange(e - t, e) for e, t in zip(ends, tail)])
    out, ref, _ = run_prefill(case, lengths, tail, q=q_full[rows.to(q_full.device)].contiguous(), seed=21,
                              config=small_tiles(case))
    hz.check(case, out, ref, "append")
    assert torch.allclose(ref, ref_full[rows], rtol=1e-12, atol=1e-12)
    assert hz.rel_l2(out, out_full[rows.to(out_full.device)]) <= hz.tolerance(case.scheme_obj, case.dtype)


def _boundary_batch(case: hz.Case) -> tuple[list[int], list[int]]:
    """(lengths, qlens) of a ragged batch of fresh chunks at page boundaries.

    Chunks of 1, page-1, page and page+1 tokens after prefixes that end mid-page
    or on a page boundary; a whole prompt longer than the residual window (its
    first pages are compressed: the chunk's own tokens sit in both pools); a
    long prefix with compressed pages and a 2-token chunk; an idle sequence; a
    prefix one token into a page (a reader that stops a page early misses it).
    """
    P, w = case.page_size, hz.residual_window(case.scheme_obj)
    prefix = [5, P + 3, 2 * P, 3, 0, w + P + 7, 9, P + 1]
    qlens = [1, P - 1, P, P + 1, w + 2 * P + 1, 2, 0, 3]
    return [a + b for a, b in zip(prefix, qlens)], qlens


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_prefill_fresh_chunk_boundaries(scheme):
    """k_new/v_new: each chunk attends its own tokens exactly and its prefix from the pages, at page boundaries."""
    case = _one_case(scheme, gqa=2, num_kv_heads=2)
    lengths, qlens = _boundary_batch(case)
    out, ref, _ = run_prefill(case, lengths, qlens, config=small_tiles(case), seed=17, fresh=True)
    hz.check(case, out, ref, f"fresh chunks, lengths {lengths}, qlens {qlens}")


QUANTIZED = ("int8", "fp8", "int4", "int2")  # two per-token and two residual schemes


@pytest.mark.parametrize("scheme", [p for p in hz.scheme_matrix() if p.values[0] in QUANTIZED])
def test_prefill_fresh_differs_from_pages(scheme):
    """The fresh path is really taken: with k_new/v_new the output leaves the all-from-pages answer.

    The first chunk starts mid-page and is longer than the residual window, so
    some of its own tokens are compressed in the pages; the fresh output must
    match [dequantized prefix ; exact chunk] and differ from the pages' answer
    by about as much as the two references differ (k_new/v_new passed as
    strided views). float32 on the CPU, so the kernel's own error (~1e-7) is
    far below the quantization error int8 adds (a few 1e-3).
    """
    case = _one_case(scheme, gqa=2, num_kv_heads=2, dtype=torch.float32 if hz.on_cpu() else None)
    P, w = case.page_size, hz.residual_window(case.scheme_obj)
    lengths = [w + 3 * P + 5, 2 * P + 7]
    qlens = [w + 2 * P + 1, P + 2]
    tol = hz.tolerance(case.scheme_obj, case.dtype)
    out_p, ref_p, _ = run_prefill(case, lengths, qlens, config=small_tiles(case), seed=19)
    hz.check(case, out_p, ref_p, "all keys from the pages")
    out_f, ref_f, _ = run_prefill(case, lengths, qlens, config=small_tiles(case), seed=19, fresh=True, strided=True)
    hz.check(case, out_f, ref_f, "chunk from k_new/v_new")
    apart = hz.rel_l2(ref_f, ref_p)
    assert apart > tol, f"the case does not separate the two key sources ({apart:.1e})"
    moved = hz.rel_l2(out_f, out_p)
    assert moved > 0.5 * apart, f"k_new/v_new barely changed the output ({moved:.1e} vs {apart:.1e}): not used?"


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("tiles, kv", [("default", "pages"), ("small", "pages"), ("small", "fresh")])
def test_prefill_sliding_window(scheme, tiles, kv):
    case = _one_case(scheme, gqa=4, num_kv_heads=1)
    window = 2 * case.page_size + 5
    lengths = _long_lengths(case) + [window - 1, window + 1]
    qlens = [lengths[0], 1, 9, lengths[3], window - 1, 3]
    cfg = small_tiles(case) if tiles == "small" else None
    out, ref, reference = run_prefill(case, lengths, qlens, window=window, config=cfg, seed=5, fresh=kv == "fresh")
    hz.check(case, out, ref, f"window {window}, kv {kv}")
    # the window must matter: full attention gives a different answer
    full_ref = reference(window=0)
    assert hz.rel_l2(full_ref, ref) > 10 * hz.tolerance(case.scheme_obj, case.dtype)


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
@pytest.mark.parametrize("window, kv", [(0, "pages"), (7, "pages"), (7, "fresh")])
def test_prefill_softcap(scheme, window, kv):
    case = _one_case(scheme, gqa=4, num_kv_heads=1)
    softcap = 2.0
    lengths = _long_lengths(case)
    qlens = chunk_lens(lengths, "append", case.page_size)
    cfg = small_tiles(case)
    # large logits so the cap bites
    out, ref, reference = run_prefill(case, lengths, qlens, softcap=softcap, window=window, q_scale=6.0, config=cfg,
                                      seed=7, fresh=kv == "fresh")
    hz.check(case, out, ref, f"softcap {softcap}, window {window}, kv {kv}")
    uncapped = reference(window=window)
    assert hz.rel_l2(uncapped, ref) > 10 * hz.tolerance(case.scheme_obj, case.dtype)


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_prefill_empty_rows_and_batch(scheme):
    """qlen 0 sequences write nothing; max_q_len 0 or an empty batch launch nothing."""
    case = _one_case(scheme, gqa=4)
    lengths = [case.page_size + 1, 3, case.page_size]
    out, ref, _ = run_prefill(case, lengths, [0, 3, 0], seed=11)
    hz.check(case, out, ref, "only the middle sequence has queries")
    dev = hz.device()
    cache = hz.make_cache(case.scheme_obj, case.head_dim, case.num_kv_heads, case.page_size, lengths, case.dtype,
                          device=dev, seed=11)
    mod = hz.load_op("prefill", scheme, case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype)
    q = torch.empty(0, case.num_kv_heads * case.gqa, case.head_dim, dtype=case.dtype, device=dev)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=dev)
    assert mod.launch(q, q, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, cu, 0, 0.1) is q


@pytest.mark.parametrize("scheme", hz.scheme_matrix())
def test_prefill_default_config_and_candidates(scheme):
    case = _one_case(scheme, gqa=8)
    mod = hz.load_op("prefill", scheme, case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype)
    keys = {"block_m", "pages_per_tile", "num_warps", "num_stages"}
    for dev in ("cpu", "cuda"):
        for max_q in (1, 5, 300, 4096):
            cfg = mod.default_config(4, max_q, 4096, dev)
            assert keys <= set(cfg)
            assert cfg["block_m"] * mod.GQA_PAD >= 16 and cfg["pages_per_tile"] * case.page_size >= 16
    # a one-token append does not pad a tall tile: 16 rows (2 tokens x 8 heads) suffice
    assert mod.default_config(4, 1, 4096, "cuda")["block_m"] == 2
    assert mod.default_config(1, 4096, 4096, "cuda")["block_m"] * mod.GQA_PAD == 128
    cands = mod.candidates(4, 4096, 4096)
    assert cands and len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    assert all(keys <= set(c) and c["block_m"] * mod.GQA_PAD >= 16 and c["pages_per_tile"] * case.page_size >= 16
               for c in cands)
    lengths = _long_lengths(case)
    qlens = chunk_lens(lengths, "append", case.page_size)
    for c in (cands[0], cands[-1]):
        out, ref, _ = run_prefill(case, lengths, qlens, config=c, seed=13)
        hz.check(case, out, ref, f"candidate {c}")


def test_prefill_rejects_bad_inputs():
    case = _one_case("fp32")
    mod = hz.load_op("prefill", "fp32", case.head_dim, case.num_kv_heads, case.gqa, case.page_size, case.dtype)
    cache = hz.make_cache("fp32", case.head_dim, case.num_kv_heads, case.page_size, [5], case.dtype)
    q = hz.random_q(5, case.num_kv_heads * case.gqa, case.head_dim, case.dtype, hz.device())
    cu = torch.tensor([0, 5], dtype=torch.int32)
    args = (cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed)
    with pytest.raises(TypeError):
        mod.launch(q, torch.empty_like(q), cache.pools, cache.block_tables.long(), cache.seq_lens,
                   cache.num_compressed, cu, 5, 0.1)
    with pytest.raises(TypeError):
        mod.launch(q, torch.empty_like(q), *args, cu.long(), 5, 0.1)
    with pytest.raises(ValueError):
        mod.launch(q[:, :1], torch.empty_like(q[:, :1]), *args, cu, 5, 0.1)
    with pytest.raises(ValueError):
        mod.launch(q, torch.empty_like(q), *args, torch.tensor([0, 2, 5], dtype=torch.int32), 5, 0.1)
    with pytest.raises(ValueError):
        mod.launch(q, torch.empty_like(q), *args, cu, 5, 0.1, config={"block_m": 12})
    with pytest.raises(KeyError):
        mod.launch(q, torch.empty_like(q), {}, *args[1:], cu, 5, 0.1)
    kv = torch.zeros(5, case.num_kv_heads, case.head_dim, dtype=case.dtype)
    with pytest.raises(ValueError, match="both"):
        mod.launch(q, torch.empty_like(q), *args, cu, 5, 0.1, k_new=kv)
    with pytest.raises(ValueError, match="k_new"):
        mod.launch(q, torch.empty_like(q), *args, cu, 5, 0.1, k_new=kv[:4], v_new=kv[:4])
    with pytest.raises(TypeError, match="v_new"):
        mod.launch(q, torch.empty_like(q), *args, cu, 5, 0.1, k_new=kv, v_new=kv.double())


# --------------------------------------------------------------------------- GPU (real sizes, bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_gpu_real_size(scheme, chunk):
    """64/8 heads, D=128, bf16, 4096-token sequences: a whole prefill, and appends after a prefix hit."""
    hz.require_cuda()
    case = hz.gpu_case(scheme)
    lengths = [4096] if chunk == "prefill" else [4096, 4096 - 17, 1000]
    qlens = [4096] if chunk == "prefill" else [512, 17, 1]
    mod = hz.load_op("prefill", scheme, case.head_dim, 8, 8, case.page_size, case.dtype, dev="cuda")
    cands = mod.candidates(len(lengths), max(qlens), 4096)
    # The default plus two candidates spread over the list: each one is a GPU compile of its own
    # (the CPU tests run the first and last tile shapes; warps and stages exist only on the GPU).
    configs = [None, *cands[1:][:: max(1, len(cands) // 2)][:2]]
    launch, reference_fn = prepare_prefill(case, lengths, qlens, dev="cuda")
    ref = reference_fn()
    for c in configs:
        hz.check(case, launch(c), ref, f"config {c or 'default'}")
    launch, reference_fn = prepare_prefill(case, lengths, qlens, dev="cuda", fresh=True)
    out, ref = launch(), reference_fn()
    hz.check(case, out, ref, "default config, chunk from k_new/v_new")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", hz.scheme_matrix("cuda"))
def test_prefill_gpu_no_host_sync(scheme):
    hz.require_cuda()
    case = hz.gpu_case(scheme)
    lengths = [4096, 100, 3000]
    qlens = [1024, 0, 7]
    cache = hz.make_cache(scheme, case.head_dim, 8, case.page_size, lengths, case.dtype, device="cuda")
    mod = hz.load_op("prefill", scheme, case.head_dim, 8, 8, case.page_size, case.dtype, dev="cuda")
    q = hz.random_q(sum(qlens), 64, case.head_dim, case.dtype, "cuda")
    out = torch.empty_like(q)
    cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device="cuda")
    args = (q, out, cache.pools, cache.block_tables, cache.seq_lens, cache.num_compressed, cu, max(qlens),
            case.head_dim ** -0.5)
    k_new, v_new = fresh_kv(cache, qlens)
    mod.launch(*args)  # compile outside the check
    mod.launch(*args, k_new=k_new, v_new=v_new)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mod.launch(*args)
        mod.launch(*args, k_new=k_new, v_new=v_new)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
