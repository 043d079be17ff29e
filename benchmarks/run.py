"""kvgen's GPU benchmark: one process, one table.

    python -m benchmarks.run [--quick] [--schemes bf16,int8,...] [--out DIR]

Measures, in this order: the device copy bandwidth (a 4 GiB device-to-device
copy, read + write bytes); every scheme's generated decode kernel at the
ANCHORS shapes (measured peer numbers kept with the project's notes) (best of the kernel's own tuning candidates,
median of triton.testing.do_bench; with ``--backend auto`` the kernel and config the runtime itself chooses
instead, see :func:`runtime_choice`), bytes it reads, fraction of copy
bandwidth, ratio to contiguous bf16 SDPA in the same run, and its error
against float32 attention over the unquantized K/V; cache writes (one decode
step and a 4096-token prefill); paged prefill at 8K against SDPA flash; and
``kvgen compile`` wall time cold and cached. Writes ``results.json`` and
``bandwidth.png`` under ``benchmarks/results/<date>-<gpu>/`` and prints the
table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvgen.atomic import write_atomic

ANCHOR_SHAPES = [  # (B, L, Hq, Hkv, D): the benchmark shapes the project tracks (Llama-3-70B/8B shards)
    (32, 4096, 64, 8, 128),
    (32, 16384, 64, 8, 128),
    (8, 32768, 64, 8, 128),
    (1, 131072, 64, 8, 128),
    (64, 2048, 32, 8, 128),
    (16, 8192, 32, 4, 64),
]
PAGE = 16
SCHEMES = ("bf16", "fp8", "int8", "int4", "int2")


def bench(fn, rep_ms: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def bench_cold(fns) -> float:
    """Median ms per call of a kernel too short for do_bench, from a CUDA graph of back-to-back calls.

    do_bench launches each call from Python after an L2 flush; a call shorter than its own
    launch (a one-layer cache write: ~10 us) then times the launch, and run to run the
    result doubles. Here ``fns`` (each one call on its own inputs; where together they are
    larger than the L2 cache, as 8 sets of a 4096-token write are, every call finds its data
    cold as in a real step; 8 sets of a 32-token write are not, and stay warm) run in turn,
    captured into one graph by the runtime's own kernel timer; the time is per call.
    """
    from kvgen.runtime.kernel_timer import graph_time_ms

    def each():
        for fn in fns:
            fn()
    return graph_time_ms(each) / len(fns)


def copy_bandwidth() -> float:
    n = 4 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def checked_time(run, out: torch.Tensor, ref: torch.Tensor, rep_ms: int = 60) -> tuple[float, float]:
    """Run once into ``out`` poisoned with NaN, check it against ``ref``, then time: ``(ms, rel. L2 error)``."""
    out.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    err = rel_l2(out.float(), ref)
    return bench(run, rep_ms=rep_ms), err


class DecodeCase:
    """Random K/V for B sequences of L tokens in one scheme's pages, shuffled page ids."""

    def __init__(self, scheme, B, L, Hq, Hkv, D, dtype=torch.bfloat16, seed=0, device="cuda"):
        from kvgen.runtime.pools import allocate_pool

        self.device = device = torch.device(device)
        g = torch.Generator(device=device).manual_seed(seed)
        self.B, self.L, self.Hq, self.Hkv, self.D = B, L, Hq, Hkv, D
        pages_per_seq = L // PAGE
        num_pages = B * pages_per_seq
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in scheme.page_tensors(D, PAGE)]
        self.pools = allocate_pool(tensors, num_pages, Hkv, dtype, device)
        nc = scheme.compressed_pages(L, PAGE)
        n_res = pages_per_seq - nc  # residual schemes keep each sequence's tail pages in the compute dtype
        self.pools.update(allocate_pool([{"name": "rk", "dtype": "compute", "shape": [PAGE, D]},
                                         {"name": "rv", "dtype": "compute", "shape": [PAGE, D]}],
                                        max(1, B * n_res), Hkv, dtype, device))
        perm = torch.randperm(num_pages, device=device, generator=g).to(torch.int32)
        self.block_tables = perm.view(B, pages_per_seq).contiguous()
        if n_res:
            self.block_tables[:, nc:] = torch.arange(B * n_res, device=device, dtype=torch.int32).view(B, n_res)
        self.seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        self.num_compressed = torch.full((B,), nc, dtype=torch.int32, device=device)
        self.q = torch.randn(B, Hq, D, generator=g, device=device, dtype=torch.float32).to(dtype)
        # Quantize chunk by chunk (all heads of a page are independent rows for every scheme).
        self.k_raw = torch.empty(B, Hkv, L, D, dtype=dtype, device=device)
        self.v_raw = torch.empty_like(self.k_raw)
        self.bytes = 0
        for b in range(B):
            k = torch.randn(Hkv, L, D, generator=g, device=device)
            v = torch.randn(Hkv, L, D, generator=g, device=device)
            self.k_raw[b], self.v_raw[b] = k.to(dtype), v.to(dtype)
            kp = k.view(Hkv, pages_per_seq, PAGE, D).transpose(0, 1)[:nc].reshape(-1, PAGE, D)
            vp = v.view(Hkv, pages_per_seq, PAGE, D).transpose(0, 1)[:nc].reshape(-1, PAGE, D)
            ids = self.block_tables[b, :nc].long()
            if nc:
                for name, t in scheme.quantize_page(kp, vp).items():
                    self.pools[name][ids] = t.view(nc, Hkv, *t.shape[1:]).to(self.pools[name].dtype)
            if n_res:
                rid = self.block_tables[b, nc:].long()
                self.pools["rk"][rid] = k.view(Hkv, pages_per_seq, PAGE, D).transpose(0, 1)[nc:].to(dtype)
                self.pools["rv"][rid] = v.view(Hkv, pages_per_seq, PAGE, D).transpose(0, 1)[nc:].to(dtype)
        for t in scheme.page_tensors(D, PAGE):
            self.bytes += self.pools[t.name][0].numel() * self.pools[t.name].element_size() * nc * B
        self.bytes += B * n_res * 2 * Hkv * PAGE * D * self.k_raw.element_size()
        self.bytes += self.block_tables.numel() * 4

    def reference(self) -> torch.Tensor:
        """float32 attention over the unquantized K/V (what a user compares against)."""
        G = self.Hq // self.Hkv
        q = self.q.float().view(self.B, self.Hkv, G, self.D)
        out = torch.empty(self.B, self.Hkv, G, self.D, device=self.device)
        for b in range(self.B):
            s = torch.einsum("hgd,hld->hgl", q[b], self.k_raw[b].float()) / math.sqrt(self.D)
            out[b] = torch.einsum("hgl,hld->hgd", s.softmax(-1), self.v_raw[b].float())
        return out.view(self.B, self.Hq, self.D)


def sdpa_decode_ms(case: DecodeCase) -> float:
    q = case.q.view(case.B, case.Hq, 1, case.D)
    f = torch.nn.functional.scaled_dot_product_attention
    return bench(lambda: f(q, case.k_raw, case.v_raw, enable_gqa=True))


def kernel_spec(op, scheme_name, Hkv, G, D, dtype="bfloat16", backend="triton"):
    """The KernelSpec of one op, scheme and shape as the benchmarks build it (sm_90, PAGE-token pages)."""
    from kvgen.codegen.spec import KernelSpec

    return KernelSpec(op=op, scheme=scheme_name, head_dim=D, num_kv_heads=Hkv, gqa_group=G, page_size=PAGE,
                      compute_dtype=dtype, arch="sm_90", backend=backend)


def kernel_module(op, scheme_name, Hkv, G, D, dtype="bfloat16", backend="triton"):
    """The op's generated kernel module for one scheme and shape (``backend`` triton or cuda), and the scheme."""
    from kvgen.codegen.loader import load_kernel
    from kvgen.registry import default_registry

    scheme = default_registry().schemes[scheme_name]
    return load_kernel(kernel_spec(op, scheme_name, Hkv, G, D, dtype, backend), scheme), scheme


def decode_backends(scheme_name, Hkv, G, D, backend):
    """The decode kernels a package compiled with ``--backend`` holds for a scheme: ``auto`` adds cuda to triton
    where its templates serve the spec (the runtime then runs one, :func:`runtime_choice`); ``cuda`` is empty for a
    scheme the CUDA templates do not serve."""
    if backend == "triton":
        return ["triton"]
    from kvgen.codegen import cuda as cuda_backend
    from kvgen.registry import default_registry

    spec = kernel_spec("decode", scheme_name, Hkv, G, D, backend="cuda")
    ok = cuda_backend.reason_unsupported(spec, default_registry().schemes[scheme_name]) is None
    return (["triton"] if backend == "auto" else []) + (["cuda"] if ok else [])


def runtime_choice(tuner, name, shapes, Hq, Hkv, D):
    """``--backend auto``: the runtime's own choice of ``name``'s decode kernel (Hq/Hkv/D) and its modules.

    As ``kvgen tune`` on a ``--backend auto`` package decides it
    (``kvgen/runtime/backend_choice.py``): every variant tuned by the runtime's
    autotuner at ``shapes`` (the anchor shapes of this kernel), their tuned
    configs timed head to head, the smaller total runs -- one kernel for all
    of them, as one package serves every shape. Timed here on each shape's
    DecodeCase (one at a time). Returns ``(BackendChoice, {backend: module})``.
    """
    from kvgen.runtime.backend_choice import choose
    from kvgen.runtime.kernel_timer import cold_page_tables, cycling

    G, sm = Hq // Hkv, 1 / math.sqrt(D)
    modules = {}
    for be in decode_backends(name, Hkv, G, D, "auto"):
        modules[be], scheme = kernel_module("decode", name, Hkv, G, D, backend=be)
    memo = {}

    def make_bench(mod, shape):
        B, L = shape
        if memo.get("shape") != (B, L):
            memo.clear()
            torch.cuda.empty_cache()
            case = DecodeCase(scheme, B, L, Hq, Hkv, D)
            # timed cold, as the runtime's own bench does (kernel_timer.cold_page_tables)
            pools, tables = cold_page_tables(case.pools, B, case.block_tables.shape[1], int(case.num_compressed[0]))
            memo.update(shape=(B, L), case=case, out=torch.empty_like(case.q), pools=pools, tables=tables)
        case, out, pools, tables = memo["case"], memo["out"], memo["pools"], memo["tables"]

        return lambda cfg: cycling(tables, lambda bt: mod.launch(case.q, out, pools, bt, case.seq_lens,
                                                                 case.num_compressed, sm, cfg))

    choice = choose(tuner, "decode", {be: (m, None) for be, m in modules.items()}, make_bench,
                    [(B, L) for B, L, *_ in shapes], explicit=True, release=memo.clear)
    memo.clear()
    torch.cuda.empty_cache()
    return choice, modules


def best_config(mod, run, batch, length):
    """Time every tuning candidate; return (best ms, best config, per-candidate times)."""
    results = []
    for cfg in mod.candidates(batch, length):
        try:
            results.append((bench(lambda: run(cfg), rep_ms=60), cfg))
        except Exception as exc:  # a candidate that does not compile (registers, smem) is skipped
            print(f"    candidate {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    if not results:
        raise RuntimeError("no tuning candidate ran")
    ms, cfg = min(results, key=lambda r: r[0])
    return bench(lambda: run(cfg)), cfg, results


def decode_records(schemes, shapes, copy_bw, log, backend="triton"):
    """Every scheme's decode at every shape against SDPA and kvgen bf16: the best tuning candidate of the backend
    ``--backend`` names; with ``auto``, the kernel the runtime chooses per scheme and kernel shape
    (:func:`runtime_choice`, recorded as ``backend`` with ``backend_why``) at the config its autotuner gives."""
    records = []
    bf16_ms = {}
    choices = {}  # (scheme, Hq, Hkv, D) -> (BackendChoice, modules): auto only
    tuner = None
    if backend == "auto":
        from kvgen.runtime.autotune import Autotuner

        # a fresh tuning folder: the choices are made in this run, not remembered from another; sync: a kernel
        # without a tuned winner for a shape (a scheme only Triton serves) is tuned on first use
        tune_dir = tempfile.TemporaryDirectory(prefix="kvgen-bench-tune-")
        tuner = Autotuner(torch.device("cuda"), mode="sync", progress=False, directory=tune_dir.name)
    for (B, L, Hq, Hkv, D) in shapes:
        sdpa_ms = None
        for name in schemes:
            case = None
            best = None  # (ms, config, backend, run)
            backends = decode_backends(name, Hkv, Hq // Hkv, D, backend)
            if not backends:
                print(f"decode {name}: no {backend} kernel for this scheme; skipped", file=sys.stderr)
                continue
            sm = 1 / math.sqrt(D)
            chosen = None
            if tuner is not None:
                if (name, Hq, Hkv, D) not in choices:
                    same_kernel = [s for s in shapes if s[2:] == (Hq, Hkv, D)]
                    choices[(name, Hq, Hkv, D)] = runtime_choice(tuner, name, same_kernel, Hq, Hkv, D)
                chosen, modules = choices[(name, Hq, Hkv, D)]
                backends = [chosen.backend]
            for be in backends:
                mod, scheme = kernel_module("decode", name, Hkv, Hq // Hkv, D, backend=be)
                if case is None:
                    case = DecodeCase(scheme, B, L, Hq, Hkv, D)
                    out = torch.empty_like(case.q)
                if sdpa_ms is None:
                    sdpa_ms = sdpa_decode_ms(case)

                def run(cfg, mod=mod):
                    mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, sm,
                               cfg)

                if chosen is not None:  # the user's path: the runtime's kernel at its autotuner's config
                    cfg = tuner.config("decode", modules[be], (B, L), lambda c, run=run: (lambda: run(c)))
                    ms = bench(lambda: run(cfg))
                else:
                    ms, cfg, _ = best_config(mod, run, B, L)
                if best is None or ms < best[0]:
                    best = (ms, cfg, be, run)
            ms, cfg, be, run = best
            out.fill_(float("nan"))  # the winner's own output is checked, not a loser's
            run(cfg)
            torch.cuda.synchronize()
            err = rel_l2(out.float(), case.reference())
            if name == "bf16":
                bf16_ms[(B, L, Hq, Hkv, D)] = ms
            rec = dict(op="decode", scheme=name, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE, ms=ms,
                       bytes=case.bytes, bw_fraction=case.bytes / (ms * 1e-3) / copy_bw, sdpa_ms=sdpa_ms,
                       ratio_to_sdpa=ms / sdpa_ms, ratio_to_bf16=ms / bf16_ms.get((B, L, Hq, Hkv, D), float("nan")),
                       rel_error=err, config=cfg, backend=be)
            if chosen is not None:
                rec.update(backend_why=chosen.why, backend_ms=dict(chosen.ms))
            log(rec)
            records.append(rec)
            del case
            torch.cuda.empty_cache()
    return records


def write_case(scheme, N, Hkv, D, *, prompt=True, device="cuda"):
    """N new tokens' K/V (bf16, random) and the pool a cache write stores them in.

    ``prompt``: consecutive slots of the prompt's own pages, the pages scattered
    over the pool; otherwise one token per sequence anywhere in the pool (a
    decode step). Residual schemes write the bf16 residual pool. Returns
    ``(k, v, pools, slots, bytes)``, bytes = K/V read + pool bytes written + slot ids.
    """
    from kvgen.runtime.pools import allocate_pool

    pages = max(64, 4 * N // PAGE)
    if scheme.residual_tokens is None:
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in scheme.page_tensors(D, PAGE)]
    else:
        tensors = [{"name": "rk", "dtype": "compute", "shape": [PAGE, D]},
                   {"name": "rv", "dtype": "compute", "shape": [PAGE, D]}]
    pools = allocate_pool(tensors, pages, Hkv, torch.bfloat16, device)
    k = torch.randn(N, Hkv, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if prompt:
        own = torch.randperm(pages, device=device)[: N // PAGE]
        slots = (own[:, None] * PAGE + torch.arange(PAGE, device=device)[None, :]).flatten().long()
    else:
        slots = torch.randperm(pages * PAGE, device=device)[:N].long()
    written = sum(pools[t["name"]][0].numel() * pools[t["name"]].element_size() for t in tensors) / PAGE * N
    return k, v, pools, slots, int(2 * k.numel() * k.element_size() + written + slots.numel() * 8)


WRITE_COPIES = 8
"""Independent input sets a write is timed over (bench_cold): 8 x ~30 MB at 4096 tokens, past the L2 cache."""


def plain_copy_ms(nbytes: int) -> float:
    """bench_cold of a device copy moving ``nbytes`` (half read, half written) over WRITE_COPIES buffer pairs:
    what a kernel of that size reaches at all."""
    copies = [(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"),
               torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")) for _ in range(WRITE_COPIES)]
    return bench_cold([lambda d=d, s=s: d.copy_(s) for d, s in copies])


def write_records(schemes, copy_bw, log):
    """Cache write (quantize + scatter) of one decode step (32 tokens) and of a 4096-token prefill.

    Timed with bench_cold (a CUDA graph of writes on rotating inputs); beside each, a plain
    device copy of the same number of bytes timed the same way (``copy_ms``): what a kernel
    this small reaches at all (the 4 GiB copy that defines copy_bw amortizes its ramp-up
    and tail, a 25 MB one does not).
    """
    records = []
    Hkv, D = 8, 128
    for name in schemes:
        mod, scheme = kernel_module("cache_write", name, Hkv, 8, D)
        for N, label in ((32, "decode step"), (4096, "prefill 4096")):
            cases = [write_case(scheme, N, Hkv, D, prompt=N != 32) for _ in range(WRITE_COPIES)]
            nbytes = cases[0][4]
            ms = bench_cold([lambda c=c: mod.launch(*c[:4]) for c in cases])
            copy_ms = plain_copy_ms(nbytes)
            copy_fraction = nbytes / (copy_ms * 1e-3) / copy_bw
            rec = dict(op="write", scheme=name, B=N, L=1, Hq=64, Hkv=Hkv, D=D, page_size=PAGE, ms=ms, bytes=nbytes,
                       bw_fraction=nbytes / (ms * 1e-3) / copy_bw, sdpa_ms=None, rel_error=None,
                       config=mod.default_config(N), copy_ms=copy_ms,
                       copy_fraction=copy_fraction, note=f"{label}; a plain copy of as many bytes: {copy_fraction:.3f}")
            log(rec)
            records.append(rec)
            del cases
            torch.cuda.empty_cache()
    return records


def prefill_records(schemes, copy_bw, log):
    """Causal prefill of B=4 prompts of 8192 tokens vs SDPA (flash) on contiguous tensors.

    "pages": every key read through the block table from the scheme's pages (a chunk
    whose K/V are already cached, e.g. after a prefix-cache hit). "fresh" (bf16 only):
    the prompt's own K/V passed as k_new/v_new, as KVCache.prefill(layer, q, k, v) runs a
    new prompt; there is no cached prefix, so no page is read.
    """
    records = []
    B, L, Hq, Hkv, D = 4, 8192, 64, 8, 128
    variants = [(name, "pages") for name in schemes] + ([("bf16", "fresh")] if "bf16" in schemes else [])
    for name, kv in variants:
        mod, scheme = kernel_module("prefill", name, Hkv, Hq // Hkv, D)
        case = DecodeCase(scheme, B, L, Hq, Hkv, D)
        q = torch.randn(B * L, Hq, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * L
        flops = 4 * B * Hq * D * L * L / 2
        fresh = {}
        if kv == "fresh":
            fresh = {"k_new": case.k_raw.transpose(1, 2).reshape(B * L, Hkv, D),
                     "v_new": case.v_raw.transpose(1, 2).reshape(B * L, Hkv, D)}

        def run(cfg):
            mod.launch(q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, cu, L, 1 / math.sqrt(D),
                       cfg, **fresh)

        ms, cfg, _ = best_config(mod, run, B, L)
        qs = q.view(B, L, Hq, D).transpose(1, 2)
        f = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms = bench(lambda: f(qs, case.k_raw, case.v_raw, is_causal=True, enable_gqa=True))
        rec = dict(op="prefill", scheme=name, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE, ms=ms, bytes=case.bytes,
                   bw_fraction=None, sdpa_ms=sdpa_ms, tflops=flops / (ms * 1e-3) / 1e12,
                   ratio_to_sdpa_throughput=sdpa_ms / ms, rel_error=None, config=cfg, note=f"kv from {kv}")
        log(rec)
        records.append(rec)
        del case
        torch.cuda.empty_cache()
    return records


def compile_records(log):
    from kvgen.codegen.package import compile_plan
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    records = []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        plan = make_plan(resolve_model("llama-3-70b"), resolve_target("h100"), Workload(), default_registry().schemes, kv="int4")
        cold = compile_plan(plan, Path(d) / plan.name)
        cold_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = make_plan(resolve_model("llama-3-70b"), resolve_target("h100"), Workload(), default_registry().schemes, kv="int4")
        warm = compile_plan(plan, Path(d) / plan.name)
        warm_s = time.perf_counter() - t1
        assert warm.unchanged
    for label, s in (("cold", cold_s), ("cached", warm_s)):
        rec = dict(op="compile", scheme="int4", B=None, L=None, Hq=64, Hkv=8, D=128, page_size=16, ms=s * 1e3,
                   bytes=None, bw_fraction=None, sdpa_ms=None, rel_error=None, note=label)
        log(rec)
        records.append(rec)
    return records


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    dec = [r for r in records if r["op"] == "decode"]
    shapes = sorted({(r["B"], r["L"], r["Hq"], r["Hkv"], r["D"]) for r in dec}, key=str)
    schemes = sorted({r["scheme"] for r in dec}, key=lambda s: SCHEMES.index(s) if s in SCHEMES else 99)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(schemes))
    for i, s in enumerate(schemes):
        ys = [next((r["bw_fraction"] for r in dec if r["scheme"] == s and (r["B"], r["L"], r["Hq"], r["Hkv"], r["D"]) == sh), 0)
              for sh in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], ys, width, label=s)
    ax.axhline(1.0, color="k", linestyle="--", label="copy bandwidth (roofline)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels([f"B{b} L{l}\n{hq}/{hk} D{d}" for b, l, hq, hk, d in shapes], fontsize=8)
    ax.set_ylabel("fraction of copy bandwidth (bytes read)")
    ax.set_title("kvgen paged decode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(records) -> str:
    lines = [f"{'op':8} {'scheme':6} {'B':>5} {'L':>7} {'Hq/Hkv':>7} {'D':>4} {'ms':>9} {'bw':>6} {'sdpa ms':>8} "
             f"{'x sdpa':>7} {'x bf16':>7} {'err':>8}  note"]
    for r in records:
        def f(key, fmt):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) and v == v else "-"
        lines.append(
            f"{r['op']:8} {r['scheme']:6} {f('B', '>5')} {f('L', '>7')} {str(r['Hq']) + '/' + str(r['Hkv']):>7} "
            f"{r['D']:>4} {f('ms', '>9.4f')} {f('bw_fraction', '>6.3f')} {f('sdpa_ms', '>8.4f')} "
            f"{f('ratio_to_sdpa', '>7.3f')} {f('ratio_to_bf16', '>7.3f')} {f('rel_error', '>8.4f')}  "
            f"{r.get('note') or r.get('backend', '')}{' %.0f TFLOP/s (x%.2f SDPA)' % (r['tflops'], r['ratio_to_sdpa_throughput']) if 'tflops' in r else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first anchor shape only")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--ops", default="decode,write,prefill,compile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", choices=("triton", "cuda", "auto"), default="triton",
                    help="decode kernels to time: triton (default), cuda (schemes it serves), or auto (the one "
                         "the runtime chooses per scheme and kernel shape over the anchor shapes, as it does for a "
                         "package compiled with --backend auto, at its autotuner's config)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU (run them on the device machine)", file=sys.stderr)
        return 2
    import triton

    from kvgen.registry import default_registry

    schemes = [s for s in args.schemes.split(",") if s in default_registry().schemes]
    shapes = ANCHOR_SHAPES[:1] if args.quick else ANCHOR_SHAPES
    gpu = torch.cuda.get_device_name()
    date = dt.date.today().isoformat()
    out_dir = Path(args.out) if args.out else Path(__file__).parent / "results" / f"{date}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}"
    out_dir.mkdir(parents=True, exist_ok=True)

    copy_bw = copy_bandwidth()
    done: list = []
    header = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, copy_bandwidth=copy_bw, date=date,
                  command="python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]))

    def log(rec):
        # Rewritten after every record, so a run cut short still leaves its numbers.
        done.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "config"}, default=str), flush=True)
        write_atomic(out_dir / "results.json", json.dumps(dict(header, records=done), indent=1, default=str) + "\n")

    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s on {gpu}", flush=True)
    ops = args.ops.split(",")
    steps = {"decode": lambda: decode_records(schemes, shapes, copy_bw, log, args.backend),
             "write": lambda: write_records(schemes, copy_bw, log),
             "prefill": lambda: prefill_records([s for s in schemes if s in ("bf16", "int8", "int4")], copy_bw, log),
             "compile": lambda: compile_records(log)}
    for op, step in steps.items():
        if op in ops:
            try:
                step()  # its records reach `done` through log()
            except Exception as exc:  # one failing op must not cost the others' numbers
                print(f"{op} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    records = done  # every logged record (log() has written results.json already), failed ops' included
    plot(records, out_dir / "bandwidth.png")
    print(f"\n{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy bandwidth {copy_bw / 1e12:.3f} TB/s, {date}")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
