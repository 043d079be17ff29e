"""kvgen's GPU benchmark: one process, one table.

    python -m benchmarks.run [--quick] [--schemes bf16,int8,...] [--out DIR]

Measures, in this order: the device copy bandwidth (a 4 GiB device-to-device
copy, read + write bytes); every scheme's generated decode kernel at the
ANCHORS shapes (measured peer numbers kept with the project's notes) (best of the kernel's own tuning candidates;
with ``--backend auto`` the kernel and config the runtime itself chooses instead, see :func:`runtime_choice`;
timed cold in L2 from a CUDA graph, and by triton.testing.do_bench beside it: benchmarks/decode_timing.py),
bytes it reads, fraction of copy
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
    """Random K/V for B sequences of L tokens in one scheme's pages, shuffled page ids. L need not be a whole number
    of pages: the last page then holds L % PAGE tokens and random data in its unwritten slots, which a kernel must
    not read (a residual scheme keeps that page in its residual pool, as the runtime does). ``bytes`` counts whole
    compressed pages and the residual pool's written rows."""

    def __init__(self, scheme, B, L, Hq, Hkv, D, dtype=torch.bfloat16, seed=0, device="cuda"):
        from kvgen.runtime.pools import allocate_pool

        self.device = device = torch.device(device)
        g = torch.Generator(device=device).manual_seed(seed)
        self.B, self.L, self.Hq, self.Hkv, self.D = B, L, Hq, Hkv, D
        pages_per_seq = -(-L // PAGE)
        padded = pages_per_seq * PAGE
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
            k = torch.randn(Hkv, padded, D, generator=g, device=device)
            v = torch.randn(Hkv, padded, D, generator=g, device=device)
            self.k_raw[b], self.v_raw[b] = k[:, :L].to(dtype), v[:, :L].to(dtype)
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
        self.bytes += B * (L - nc * PAGE if n_res else 0) * 2 * Hkv * D * self.k_raw.element_size()
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


def sdpa_decode_ms(case: DecodeCase, timer: str = "do_bench") -> float:
    """Contiguous SDPA over the case's unquantized K/V, by ``timer`` (benchmarks.decode_timing)."""
    return sdpa_decode_times(case, (timer,))[timer]


def sdpa_decode_times(case: DecodeCase, timers=("graph", "do_bench")) -> dict:
    from benchmarks.decode_timing import sdpa_times

    return sdpa_times(case.q.view(case.B, case.Hq, 1, case.D), case.k_raw, case.v_raw, timers)


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
    from benchmarks.decode_timing import DecodeTimer
    from kvgen.runtime.backend_choice import choose

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
            # timed cold, as the runtime's own bench does (kernel_timer.cold_page_tables), but at the anchor's
            # length alone: the runtime's tuning also times half of it (KVCache._bench), for the lengths a
            # bucket serves; an anchor table measures exactly its lengths
            memo.update(shape=(B, L), case=case, out=torch.empty_like(case.q),
                        timer=DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0])))
        case, out, dt = memo["case"], memo["out"], memo["timer"]

        def launch(cfg, pools, tables):
            mod.launch(case.q, out, pools, tables, case.seq_lens, case.num_compressed, sm, cfg)
        return lambda cfg: dt.cold_call(launch, cfg)

    choice = choose(tuner, "decode", {be: (m, None) for be, m in modules.items()}, make_bench,
                    [(B, L) for B, L, *_ in shapes], explicit=True, release=memo.clear)
    memo.clear()
    torch.cuda.empty_cache()
    return choice, modules


def best_config(mod, run, batch, length, rank=None):
    """Time every tuning candidate; return (best ms, best config, per-candidate times). ``rank(cfg)``: ms to rank
    a candidate by; the best's own is returned, as the caller times the winner itself. Default: do_bench of
    ``run(cfg)``, a short run for ranking and a longer one for the best. The front-runners are ranked again as the
    runtime's autotuner confirms its own (``kvgen.runtime.autotune.confirm_front_runners``): one reading can fall
    in a stretch the GPU runs slow."""
    from kvgen.runtime.autotune import confirm_front_runners

    reading = rank or (lambda c: bench(lambda: run(c), rep_ms=60))
    readings = []  # [config, ms, config]: the "bench" the confirmation times again is the config itself
    for cfg in mod.candidates(batch, length):
        try:
            readings.append([cfg, reading(cfg), cfg])
        except Exception as exc:  # a candidate that does not compile (registers, smem) is skipped
            print(f"    candidate {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    if not readings:
        raise RuntimeError("no tuning candidate ran")
    confirm_front_runners(readings, reading)
    cfg, ms, _ = min(readings, key=lambda r: r[1])
    results = [(r[1], r[0]) for r in readings]
    return (ms if rank else bench(lambda: run(cfg))), cfg, results


def decode_records(schemes, shapes, copy_bw, log, backend="triton", timer="graph"):
    """Every scheme's decode at every shape against SDPA and kvgen bf16: the best tuning candidate of the backend
    ``--backend`` names; with ``auto``, the kernel the runtime chooses per scheme and kernel shape
    (:func:`runtime_choice`, recorded as ``backend`` with ``backend_why``) at the config its autotuner gives.
    ``ms`` and the ratios are by ``timer`` (benchmarks.decode_timing: ``graph``, cold from a CUDA graph, or
    ``do_bench``); ``ms_graph``/``ms_do_bench`` and ``ratio_to_*_do_bench`` keep both."""
    from benchmarks.decode_timing import DecodeTimer

    records = []
    bf16_ms = {}
    bf16_do_bench = {}
    choices = {}  # (scheme, Hq, Hkv, D) -> (BackendChoice, modules): auto only
    tuner = None
    if backend == "auto":
        from kvgen.runtime.autotune import Autotuner

        # a fresh tuning folder: the choices are made in this run, not remembered from another; sync: a kernel
        # without a tuned winner for a shape (a scheme only Triton serves) is tuned on first use
        tune_dir = tempfile.TemporaryDirectory(prefix="kvgen-bench-tune-")
        tuner = Autotuner(torch.device("cuda"), mode="sync", progress=False, directory=tune_dir.name)
    for (B, L, Hq, Hkv, D) in shapes:
        sdpa = None
        for name in schemes:
            case = None
            best = None  # (ms by each timer, config, backend, run, launch)
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
                    dt = DecodeTimer(case.pools, case.block_tables, int(case.num_compressed[0]), timer)
                if sdpa is None:
                    sdpa = sdpa_decode_times(case)

                def launch(cfg, pools, tables, mod=mod):
                    mod.launch(case.q, out, pools, tables, case.seq_lens, case.num_compressed, sm, cfg)

                def run(cfg, launch=launch):
                    launch(cfg, case.pools, case.block_tables)

                if chosen is not None:  # the user's path: the runtime's kernel at its autotuner's config
                    cfg = tuner.config("decode", modules[be], (B, L), lambda c, run=run: (lambda: run(c)))
                else:
                    _, cfg, _ = best_config(mod, run, B, L, lambda c, launch=launch: dt.ms(launch, c, quick=True))
                times = dt.both(launch, cfg)  # each backend's pick by each timer, one after the other
                if best is None or times[timer] < best[0][timer]:
                    best = (times, cfg, be, run)
            times, cfg, be, run = best
            ms = times[timer]
            out.fill_(float("nan"))  # the winner's own output is checked, not a loser's
            run(cfg)
            torch.cuda.synchronize()
            err = rel_l2(out.float(), case.reference())
            key = (B, L, Hq, Hkv, D)
            if name == "bf16":
                bf16_ms[key], bf16_do_bench[key] = ms, times["do_bench"]
            nan = float("nan")
            rec = dict(op="decode", scheme=name, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE, ms=ms, timer=timer,
                       ms_graph=times["graph"], ms_graph_rounds=times["graph_rounds"],
                       ms_do_bench=times["do_bench"],
                       bytes=case.bytes, bw_fraction=case.bytes / (ms * 1e-3) / copy_bw, sdpa_ms=sdpa[timer],
                       sdpa_ms_graph=sdpa["graph"], sdpa_ms_graph_rounds=sdpa["graph_rounds"],
                       sdpa_ms_do_bench=sdpa["do_bench"],
                       ratio_to_sdpa=ms / sdpa[timer], ratio_to_bf16=ms / bf16_ms.get(key, nan),
                       ratio_to_sdpa_do_bench=times["do_bench"] / sdpa["do_bench"],
                       ratio_to_bf16_do_bench=times["do_bench"] / bf16_do_bench.get(key, nan),
                       rel_error=err, config=cfg, backend=be)
            if chosen is not None:
                rec.update(backend_why=chosen.why, backend_ms=dict(chosen.ms))
            log(rec)
            records.append(rec)
            del case
            torch.cuda.empty_cache()
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


def anchor_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
    """``"1x131072,32x4096"`` -> those ANCHOR_SHAPES, in the order named (SystemExit naming the choices otherwise)."""
    by_name = {f"{shape[0]}x{shape[1]}": shape for shape in ANCHOR_SHAPES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise SystemExit(f"--shapes takes anchor shapes BxL from {', '.join(by_name)}; got {text!r}")
    return [by_name[n] for n in names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="first anchor shape only")
    ap.add_argument("--shapes", default=None,
                    help="decode: only these anchor shapes, as BxL (e.g. 1x131072,32x4096); the runtime's choice "
                         "under --backend auto then weighs only these")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--ops", default="decode,write,prefill,compile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", choices=("triton", "cuda", "auto"), default="triton",
                    help="decode kernels to time: triton (default), cuda (schemes it serves), or auto (the one "
                         "the runtime chooses per scheme and kernel shape over the anchor shapes, as it does for a "
                         "package compiled with --backend auto, at its autotuner's config)")
    ap.add_argument("--decode-timer", choices=("graph", "do_bench"), default="graph",
                    help="decode's ms and ratios: graph (default; cold in L2, from a CUDA graph, as the engine and "
                         "the autotuner run it) or do_bench (zero-flushed L2; the timer until 2026-12-03); both "
                         "are recorded (benchmarks/decode_timing.py)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU (run them on the device machine)", file=sys.stderr)
        return 2
    import triton

    from kvgen.registry import default_registry

    schemes = [s for s in args.schemes.split(",") if s in default_registry().schemes]
    shapes = ANCHOR_SHAPES[:1] if args.quick else anchor_shapes(args.shapes) if args.shapes else ANCHOR_SHAPES
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
    from benchmarks.run_other_ops import compile_records, prefill_records, write_records

    steps = {"decode": lambda: decode_records(schemes, shapes, copy_bw, log, args.backend, args.decode_timer),
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
