"""Variants of the CUDA decode kernel's source, timed head to head in one process (a GPU), each one checked.

    # offline (no GPU): render the variants' .cu sources into DIR
    python -m benchmarks.experiments.decode_variants render DIR [--schemes int4,int8] [--base REV|tree] [--heads 64,8]
                                                      [--head-dim 128] [--reg-caps 20,24] [--split-major]
                                                      [--no-residual-pass] [--page-record] [--revs REV,...]
    # on the GPU: build every source in DIR, check it and time it at each shape
    python -m benchmarks.experiments.decode_variants time DIR [--shapes 32x4096,1x16384] [--out FILE] [--heads 64,8]
                                                    [--head-dim 128]

``render`` writes, per scheme, ``<scheme>--base.cu`` (the decode kernel as git revision ``--base`` renders it,
through that revision's own templates, unpacked with ``git archive`` into a temporary folder) and
``<scheme>--tree.cu`` (the working tree's; ``--base tree`` writes the tree's as the base alone, for a scheme or head
dim the revision cannot render); ``--revs REV,...`` also writes ``<scheme>--<REV>.cu`` (``/`` as ``_``) as each
revision renders it, e.g. candidate branches to time against the base. ``--reg-caps W,...`` also writes
``<scheme>--regsW.cu``: the tree's kernel with its register cap at W warps an SM instead of 16
(``cuda_sass.with_reg_cap``); ``--split-major`` writes ``<scheme>--splitmajor.cu``: the tree's kernel on the grid
(splits, KV heads, batch) instead of (batch, KV heads, splits), so the programs the hardware schedules next to each
other are one head's splits, not one split's heads (:func:`with_split_major`); ``--no-residual-pass`` writes
``<scheme>--noresidual.cu``: a residual scheme's kernel without its residual pool's tile loop
(:func:`without_residual_pass`; the same output only where no sequence has a residual tile, e.g. int4 at whole
pages); ``--page-record`` writes ``<scheme>--record.cu``: the kernel reading each (page, KV head)'s tensors from one
record, which ``time`` runs over the same pages copied into records (:func:`with_page_record`, :func:`as_records`).
Other variants can be added by hand as ``<scheme>--<name>.cu`` (e.g. the tree rendered with an edited template).
``time`` loads the scheme's generated CUDA decode module once and points it at each source in turn (``SOURCE``: the
runtime's CUDA loader builds and caches each), runs it once on a NaN-poisoned output against the float32 reference
and against the base variant's output; a variant whose output is not finite or differs from the base's by more than
``--max-vs-base`` (relative L2) gets an error record and is not timed (where the base fails, the next variant is
compared and timed as the base). It then times every tuning candidate of the module (splits x warps x depths) with
the runtime's kernel timer, cold pages cycled as the runtime's own tuning does, and reports the best per variant and
shape, as a ratio to the base variant measured in the same process. ``--heads HQ,HKV`` (query and KV heads, default
the ANCHORS' 64,8) and ``--head-dim`` must be the same for both steps: they are compiled into the source. ``time``
first builds every source, several nvcc processes at once, so the first timed launch of a variant waits on no
compile.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HQ, HKV, D, PAGE = 64, 8, 128, 16
# the tree's templates and built-in plugins are the packages kvgen_templates and kvgen_plugins (an editable install
# maps them to the checkout's templates/ and plugins/): in another tree, those names must resolve to its own
RENDER = ("import sys, templates, plugins; sys.modules['kvgen_templates'] = templates; "
          "sys.modules['kvgen_plugins'] = plugins; "
          "from benchmarks.experiments.cuda_sass import render; "
          "sys.stdout.write(render(sys.argv[1], {d}, {g}, {p}{h}))")


def _render_at(root: Path, scheme: str, hq: int, hkv: int, d: int = D) -> str:
    """The decode .cu of ``scheme`` as the tree at ``root`` renders it (its own kvgen, templates and plugins)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    # the KV head count is compiled in; revisions before 2026-12-05 render 8 and do not take it
    code = RENDER.format(d=d, g=hq // hkv, p=PAGE, h="" if hkv == 8 else f", kv_heads={hkv}")
    return subprocess.run([sys.executable, "-c", code, scheme], cwd=root, env=env, check=True,
                          capture_output=True, text=True).stdout


GRID_INDEX = "const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;"
GRID_LAUNCH = "dim3(batch, H, a.num_splits)"


def with_split_major(source: str) -> str:
    """``source`` with its decode kernel's grid in (splits, KV heads, batch) order, its indexing to match; SystemExit
    where the template no longer reads :data:`GRID_INDEX` and :data:`GRID_LAUNCH` once each."""
    if source.count(GRID_INDEX) != 1 or source.count(GRID_LAUNCH) != 1:
        raise SystemExit("the decode kernel's grid is no longer (batch, heads, splits) as this variant expects")
    return (source.replace(GRID_INDEX, "const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;")
            .replace(GRID_LAUNCH, "dim3(a.num_splits, H, batch)"))


RESIDUAL_PASS = "  run_tiles(Tag<ResidualReader>(), a.rpools, max(t_begin, comp_end), t_end);\n"


def without_residual_pass(source: str) -> str:
    """``source`` without the residual pool's tile loop: the kernel's code less the ResidualReader instance of the
    loop, its shared memory unchanged. It asks whether int4's larger fixed cost a launch (2026-12-05-nvidia-h100-5)
    comes with its code's size. Not that alone: offline (sm_90a, int4 <4,2>) the kernel drops from 1976 to 1368
    instructions, but ptxas then gives the compressed loop 114 registers instead of 128, no spill, and 504
    instructions instead of 466. Its output is the kernel's only where no sequence reaches a residual tile.
    SystemExit where the template no longer calls that loop as :data:`RESIDUAL_PASS` once."""
    if source.count(RESIDUAL_PASS) != 1:
        raise SystemExit("the decode kernel no longer calls its residual pass as this variant expects (or the "
                         "scheme keeps no residual)")
    return source.replace(RESIDUAL_PASS, "")


META_STRIDES = ("R::meta_src(p, i), MB, t, ph_tile)", "R::meta_src(p, i) + (unsigned long long)ph_tile * MB + u * CU")


def record_layout(scheme: str, d: int = D) -> list[tuple[str, int]]:
    """(tensor, bytes per (page, KV head)) of ``scheme``'s page tensors, in the scheme's order: one page record."""
    from kvgen.registry import default_registry
    from kvgen.schemes import dtype_bytes

    return [(t.name, math.prod(t.shape) * dtype_bytes(t.dtype))
            for t in default_registry().schemes[scheme].page_tensors(d, PAGE)]


def with_page_record(source: str, record_bytes: int) -> str:
    """``source`` reading its page tensors from one record per (page, KV head): every tensor of the scheme's reader
    (``PageReader``; not a residual pool's) is addressed at its own base plus (page * H + head) * ``record_bytes``
    instead of its own block's bytes. :func:`as_records` lays pools out so. It asks whether the six pools of a
    KIVI page cost the decode DRAM throughput or address instructions. SystemExit where the template no longer
    reads as this variant expects."""
    m = re.search(r"struct PageReader\b[^{]*\{", source)
    if m is None or any(source.count(x) != 1 for x in META_STRIDES):
        raise SystemExit("the decode kernel no longer declares its reader or strides its metadata as this variant "
                         "expects")
    head, tail = source[:m.start()], source[m.start():]
    for name in ("K_PAGE_BYTES", "V_PAGE_BYTES"):  # the first declarations past PageReader's are its own
        tail, n = re.subn(rf"static constexpr long long {name} = [^;]+;", f"static constexpr long long {name} = "
                          "RECORD_BYTES;", tail, count=1)
        if n != 1:
            raise SystemExit(f"the decode kernel's reader no longer declares {name} as this variant expects")
    out = head + f"constexpr long long RECORD_BYTES = {record_bytes};  // one page record\n" + tail
    # a metadata tensor's blocks: RECORD_BYTES apart for the scheme's reader (the residual reader has none)
    out = out.replace(META_STRIDES[0], "R::meta_src(p, i), RECORD_BYTES, t, ph_tile)")
    return out.replace(META_STRIDES[1], "R::meta_src(p, i) + (unsigned long long)ph_tile * RECORD_BYTES + u * CU")


def as_records(pools: dict, names: list[str]) -> dict:
    """``pools`` with tensors ``names`` copied into one buffer of [pages, H, record] bytes, each tensor's (page,
    head) block at its offset in the record, in ``names``' order. Each returned tensor is a contiguous view with the
    original shape whose first byte is its first record's block: only its data pointer means anything (the kernel
    of :func:`with_page_record` strides by the record), so it passes the module's checks of contiguity and
    alignment. The other tensors (a residual pool's) are returned as they are."""
    import torch

    P, H = pools[names[0]].shape[:2]
    sizes = [pools[n][0, 0].numel() * pools[n].element_size() for n in names]
    buf = torch.empty(P, H, sum(sizes), dtype=torch.uint8, device=pools[names[0]].device)
    flat, out, off = buf.view(-1), dict(pools), 0
    for n, size in zip(names, sizes):
        t = pools[n]
        buf[:, :, off:off + size] = t.view(torch.uint8).reshape(P, H, size)
        out[n] = flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        off += size
    return out


def _unpack(rev: str, into: Path) -> Path:
    """The files of git revision ``rev`` of this repository, unpacked into ``into`` (``git archive``)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def variant_name(rev: str) -> str:
    """The file-name part a revision's variant takes: the revision with characters other than letters, digits, '.'
    and '-' as '_' (``candidate/bt-pointer`` -> ``candidate_bt-pointer``)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", rev)


def render(out_dir: Path, schemes: list[str], base: str, hq: int = HQ, hkv: int = HKV, d: int = D,
           reg_caps: tuple[int, ...] = (), split_major: bool = False, no_residual_pass: bool = False,
           page_record: bool = False, revs: tuple[str, ...] = ()) -> None:
    from benchmarks.experiments.cuda_sass import with_reg_cap

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base_root = None if base == "tree" else _unpack(base, Path(tmp) / "base")
        rev_roots = {variant_name(r): _unpack(r, Path(tmp) / f"rev{i}") for i, r in enumerate(revs)}
        for s in schemes:
            tree = _render_at(REPO, s, hq, hkv, d)
            sources = {"base": tree} if base_root is None else {"base": _render_at(base_root, s, hq, hkv, d),
                                                                "tree": tree}
            sources.update({name: _render_at(root, s, hq, hkv, d) for name, root in rev_roots.items()})
            sources.update({f"regs{w}": with_reg_cap(tree, w) for w in reg_caps})
            if split_major:
                sources["splitmajor"] = with_split_major(tree)
            if no_residual_pass and RESIDUAL_PASS in tree:  # schemes without a residual have no such variant
                sources["noresidual"] = without_residual_pass(tree)
            if page_record:
                sources["record"] = with_page_record(tree, sum(b for _, b in record_layout(s, d)))
            for name, text in sources.items():
                (out_dir / f"{s}--{name}.cu").write_text(text)
            print(f"{s}: {', '.join(sources)}", file=sys.stderr)


def build_all(files: list[Path], arch: str = "sm_90a") -> None:
    """Build every source into the runtime's build cache, a few nvcc processes at once (each is one process)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvgen.runtime import cuda_loader

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for f, path in zip(files, pool.map(lambda f: cuda_loader.build(f.read_text(), arch), files)):
            print(f"built {f.name}: {path.name}", file=sys.stderr)


def time_variants(src_dir: Path, shapes: list[tuple[int, int]], out: Path | None,
                  max_vs_base: float = 1e-2, hq: int = HQ, hkv: int = HKV, d: int = D) -> list[dict]:
    import torch

    from benchmarks.experiments.records import write_records
    from benchmarks.run import DecodeCase, best_config, kernel_module, rel_l2
    from kvgen.runtime.kernel_timer import cold_page_tables, cycling, graph_time_ms

    build_all(sorted(src_dir.glob("*.cu")))
    records = []
    by_scheme: dict[str, list[Path]] = {}
    for f in sorted(src_dir.glob("*.cu")):
        by_scheme.setdefault(f.name.split("--")[0], []).append(f)
    for scheme_name, files in by_scheme.items():
        files.sort(key=lambda f: (not f.stem.endswith("--base"), f.name))
        mod, scheme = kernel_module("decode", scheme_name, hkv, hq // hkv, d, backend="cuda")
        record = [n for n, _ in record_layout(scheme_name, d)]
        for B, L in shapes:
            torch.cuda.empty_cache()
            case = DecodeCase(scheme, B, L, hq, hkv, d)
            ref = case.reference()
            sm = 1 / math.sqrt(d)
            pools, tables = cold_page_tables(case.pools, B, case.block_tables.shape[1], int(case.num_compressed[0]))
            out_t = torch.empty_like(case.q)
            base_out, base_ms = None, None
            for f in files:
                mod.SOURCE = f
                variant = f.stem.split("--", 1)[1]
                # the page-record variant reads the same pages laid out as records
                case_pools, timed_pools = ((as_records(case.pools, record), as_records(pools, record))
                                           if variant == "record" else (case.pools, pools))
                check = torch.full_like(case.q, float("nan"))
                mod.launch(case.q, check, case_pools, case.block_tables, case.seq_lens, case.num_compressed, sm,
                           mod.default_config(B, L, case.q.device))
                torch.cuda.synchronize()
                err = rel_l2(check.float(), ref)
                vs_base = 0.0 if base_out is None else rel_l2(check.float(), base_out.float())
                if not bool(torch.isfinite(check).all()) or vs_base > max_vs_base:
                    # recorded and skipped: the other variants and schemes are still timed
                    why = (f"output not finite or {vs_base:.3g} from the base's (relative L2, limit {max_vs_base}); "
                           f"{err:.3g} from the float32 reference")
                    records.append({"scheme": scheme_name, "variant": variant, "B": B, "L": L, "heads": [hq, hkv],
                                    "head_dim": d, "error": why})
                    print(f"{scheme_name:5s} B={B:3d} L={L:6d} {variant:12s} FAILED: {why}", flush=True)
                    continue
                if base_out is None:
                    base_out = check
                ms, cfg, times = best_config(mod, None, B, L, lambda c: graph_time_ms(cycling(
                    tables, lambda bt: mod.launch(case.q, out_t, timed_pools, bt, case.seq_lens, case.num_compressed,
                                                  sm, c))))
                if base_ms is None:
                    base_ms = ms
                rec = {"scheme": scheme_name, "variant": variant, "B": B, "L": L, "heads": [hq, hkv], "head_dim": d,
                       "ms": ms, "config": cfg,
                       "vs_base": ms / base_ms, "rel_l2": err, "rel_l2_vs_base": vs_base,
                       "candidates": [[t, c] for t, c in times]}
                records.append(rec)
                print(f"{scheme_name:5s} B={B:3d} L={L:6d} {variant:12s} {ms * 1e3:8.1f} us  x{ms / base_ms:.3f}  "
                      f"err {err:.4f}  vs base {vs_base:.2e}  {cfg}", flush=True)
                del case_pools, timed_pools
            del case, pools, tables
    if out is not None:
        write_records(out, records)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("dir", type=Path)
    r.add_argument("--schemes", default="bf16,fp8,int8,int4,int2")
    r.add_argument("--base", default="HEAD")
    r.add_argument("--heads", default=f"{HQ},{HKV}", help="query and KV heads, HQ,HKV")
    r.add_argument("--head-dim", type=int, default=D)
    r.add_argument("--reg-caps", default="", help="also the tree's kernel at these register caps (warps an SM)")
    r.add_argument("--split-major", action="store_true", help="also the tree's kernel on a (splits, heads, batch) grid")
    r.add_argument("--no-residual-pass", action="store_true",
                   help="also a residual scheme's kernel without its residual tile loop")
    r.add_argument("--page-record", action="store_true",
                   help="also the tree's kernel reading each (page, head)'s tensors from one record")
    r.add_argument("--revs", default="", help="also the kernel as each of these git revisions renders it, "
                   "comma-separated (candidate branches timed against the base in one process)")
    t = sub.add_parser("time")
    t.add_argument("dir", type=Path)
    t.add_argument("--shapes", default="32x4096,1x16384")
    t.add_argument("--out", type=Path)
    t.add_argument("--max-vs-base", type=float, default=1e-2)
    t.add_argument("--heads", default=f"{HQ},{HKV}", help="query and KV heads, HQ,HKV (as rendered)")
    t.add_argument("--head-dim", type=int, default=D, help="as rendered")
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split(","))
    if a.cmd == "render":
        render(a.dir, a.schemes.split(","), a.base, hq, hkv, a.head_dim,
               tuple(int(w) for w in a.reg_caps.split(",") if w), a.split_major, a.no_residual_pass, a.page_record,
               tuple(r for r in a.revs.split(",") if r))
    else:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        time_variants(a.dir, shapes, a.out, a.max_vs_base, hq, hkv, a.head_dim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
