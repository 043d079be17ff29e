"""Build the CUDA decode kernel for sm_90a offline (no GPU): registers, spills, shared memory and the SASS
instruction mix of its tile loop, per scheme and template instance (``decode_kernel<NW, DEPTH>``).

    python -m benchmarks.experiments.cuda_sass int4 int8 bf16 [--head-dim 128] [--gqa 8] [--page 16]
                                              [--instance 4,3] [--sass-dir DIR] [--reg-cap-warps 24] [--by-line 25]

For each scheme it renders the decode kernel as ``kvgen compile --backend cuda`` does (one layer, 8 KV
heads, bf16 compute), compiles it with nvcc to a cubin (``-O3 -arch=sm_90a -Xptxas -v``; the flags of the
runtime's build minus ``--shared``), reads ptxas's per-function report, and disassembles with the
``cuobjdump`` Triton ships. The "tile loop" is the largest loop of the instance's SASS (the longest span
between a backward branch and its target, all instructions inside it counted once: per warp, per pass);
its opcodes are grouped by their first word (IMAD.MOV and IMAD.WIDE count as IMAD). The count "when no maximum
moves" leaves out the lazy rescale, the branch the loop's vote skips on most tiles. ``--by-line N`` lists the N
source lines of the rendered kernel that most instructions of that path come from (``nvdisasm -gi``, the
innermost inlined line, and the line it was inlined at), the cost map of the tile loop. This is the offline
companion of ``gpu_session.sh ncu``: instruction counts move before a GPU is at hand, timings do not.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.experiments.sass_text import opcode, skipped_by_vote, source_lines

NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "-arch=sm_90a", "-cubin", "-Xptxas", "-v")
INSTANCE = re.compile(r"decode_kernelILi(\d+)ELi(\d+)E")


def cuda_tool(name: str) -> str | None:
    """``name`` (cuobjdump, nvdisasm) on the PATH, else the one in Triton's NVIDIA backend (no CUDA toolkit
    install needed)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.is_file() else None


def cuobjdump() -> str | None:
    """``cuobjdump`` (:func:`cuda_tool`)."""
    return cuda_tool("cuobjdump")


def line_costs(cubin: Path, function: str, addresses: list[int], source: Path, top: int) -> list[str]:
    """The ``top`` lines of ``source`` (the rendered .cu the cubin was built from) that most of the instructions at
    ``addresses`` of ``function`` come from: per instruction its innermost frame in that file (an intrinsic's header
    line is not it) and the line that frame was inlined at, each shown as "count  L<line> <text>  (at L<line>:
    <text>)"; a note where there is no nvdisasm."""
    tool = cuda_tool("nvdisasm")
    if tool is None:
        return ["    (no nvdisasm: no source lines)"]
    text = subprocess.run([tool, "-gi", str(cubin)], capture_output=True, text=True, check=True).stdout
    own = source.read_text().splitlines()
    counts = collections.Counter()
    for chain in map(source_lines(text, function).get, addresses):
        mine = [n for f, n in chain or [] if Path(f).name == source.name]
        counts[tuple(mine[:2])] += 1

    def show(n: int) -> str:
        return own[n - 1].strip()[:90] if 0 < n <= len(own) else "?"
    out = []
    for chain, n in counts.most_common(top):
        where = f"L{chain[0]:<5d} {show(chain[0])}" if chain else "(no line)"
        via = f"  (at L{chain[1]}: {show(chain[1])[:50]})" if len(chain) > 1 else ""
        out.append(f"    {n:4d}  {where}{via}")
    return out


REG_CAP = "__launch_bounds__(NW * 32, 16 / NW)"
"""The decode kernel's register cap as templates/cuda/decode.cu.j2 renders it (16 warps an SM; D <= 128, G <= 8)."""


def with_reg_cap(source: str, warps: int) -> str:
    """``source`` with its register cap at ``warps`` warps an SM instead of 16; SystemExit where it has none."""
    if REG_CAP not in source:
        raise SystemExit("this kernel has no register cap to change (D > 128 or a group past 8, or the template's "
                         f"cap no longer reads {REG_CAP!r})")
    return source.replace(REG_CAP, f"__launch_bounds__(NW * 32, {warps} / NW)")


def render(scheme: str, head_dim: int, gqa: int, page: int, kv_heads: int = 8) -> str:
    """The ``.cu`` source of the scheme's CUDA decode kernel (a PluginError-free KernelSpec or SystemExit); the
    KV head count is compiled into it (pool strides)."""
    from kvgen.codegen.cuda import reason_unsupported
    from kvgen.codegen.render import render_sources
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import default_registry

    reg = default_registry()
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=head_dim, num_kv_heads=kv_heads, gqa_group=gqa,
                      page_size=page, compute_dtype="bfloat16", arch="sm_90", backend="cuda")
    why = reason_unsupported(spec, reg.schemes[scheme], reg)
    if why:
        raise SystemExit(f"{scheme}: no CUDA decode for this spec ({why})")
    return render_sources(spec, reg.schemes[scheme], reg)[".cu"]


def ptxas_report(stderr: str) -> dict[tuple[int, int], dict[str, int]]:
    """(NW, DEPTH) -> registers, spill stores/loads (bytes), shared memory (bytes), from ``-Xptxas -v``."""
    out: dict[tuple[int, int], dict[str, int]] = {}
    current = None
    for line in stderr.splitlines():
        if "Compiling entry function" in line or "Function properties for" in line:
            m = INSTANCE.search(line)  # another function (the split reduce) resets it
            current = (int(m.group(1)), int(m.group(2))) if m else None
            if current is not None:
                out.setdefault(current, {})
        if current is None:
            continue
        rec = out[current]
        if (r := re.search(r"Used (\d+) registers", line)):
            rec["regs"] = int(r.group(1))
        if (r := re.search(r"(\d+) bytes smem", line)):
            rec["smem"] = int(r.group(1))
        if (r := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            rec["spill_st"], rec["spill_ld"] = int(r.group(1)), int(r.group(2))
    return out


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Mangled function name -> its instructions as (address, text), from ``cuobjdump -sass``."""
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in sass.splitlines():
        if (m := re.match(r"\s*Function : (\S+)", line)):
            name = m.group(1)
            out[name] = []
            continue
        if name is None:
            continue
        if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)):
            out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def largest_loop(instrs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions of the longest span [target, branch] of a backward branch that holds no EXIT and some
    HMMA (the tile loop; empty if there is none): the warp-divergence fallbacks nvcc places after the
    function's end branch back into it, across its EXIT, and are no loop; loops without MMAs (an epilogue's)
    are not the tile loop."""
    exits = [a for a, t in instrs if opcode(t) == "EXIT"]
    mmas = [a for a, t in instrs if opcode(t) == "HMMA"]
    best: tuple[int, int] | None = None
    for addr, text in instrs:
        if opcode(text) != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if not m:
            continue
        target = int(m.group(1), 16)
        if any(target <= e <= addr for e in exits) or not any(target <= a <= addr for a in mmas):
            continue
        if target < addr and (best is None or addr - target > best[1] - best[0]):
            best = (target, addr)
    if best is None:
        return []
    return [(a, t) for a, t in instrs if best[0] <= a <= best[1]]


def analyse(scheme: str, args: argparse.Namespace, work: Path) -> list[str]:
    src = work / f"{scheme}.cu"
    text = render(scheme, args.head_dim, args.gqa, args.page)
    src.write_text(with_reg_cap(text, args.reg_cap_warps) if args.reg_cap_warps else text)
    cubin = work / f"{scheme}.cubin"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not found")
    built = subprocess.run([nvcc, *NVCC_FLAGS, "-o", str(cubin), str(src)], capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"{scheme}: nvcc failed:\n{built.stderr[-3000:]}")
    report = ptxas_report(built.stderr)
    lines = []
    for (nw, depth), rec in sorted(report.items()):
        occ = min(64 // nw, 65536 // (max(rec.get("regs", 1), 1) * 32 * nw)) * nw if rec.get("regs") else None
        lines.append(f"{scheme} d={args.head_dim} g={args.gqa} page={args.page} <{nw},{depth}>: "
                     f"regs {rec.get('regs')}, spills {rec.get('spill_st', 0)}/{rec.get('spill_ld', 0)} B, "
                     f"static smem {rec.get('smem', 0)} B, warps/SM by registers {occ}")
    tool = cuobjdump()
    if tool is None:
        lines.append("  (no cuobjdump: SASS not read)")
        return lines
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    want = tuple(int(x) for x in args.instance.split(","))
    built = {(int(m.group(1)), int(m.group(2))): name for name in functions(sass) if (m := INSTANCE.search(name))}
    if want not in built and built:  # e.g. 16-bit pages build depth 2 only: the nearest instance of as many warps
        want = min(built, key=lambda k: (k[0] != want[0], abs(k[1] - want[1])))
    for name, instrs in functions(sass).items():
        if built.get(want) != name:
            continue
        loop = largest_loop(instrs)
        rare = skipped_by_vote(loop)
        mix = collections.Counter(opcode(t) for _, t in loop)
        mmas = mix.get("HMMA", 0)
        # one pass = one 16-token tile: (D/16 k-steps of K q^T + D/16 row tiles of V^T P^T) MMAs per 8 heads, and
        # D/16 more where the reader folds its key scales (the page's zeros against q: decode.cu.j2, key scale fold)
        per_tile = (3 if "K_FOLD = true" in src.read_text() else 2) * args.head_dim // 16 * -(-args.gqa // 8)
        tiles = mmas / per_tile if mmas else 0
        per_token = f", {len(loop) / (16 * tiles):.1f} warp-instructions per token and KV head" if tiles else ""
        lines.append(f"  {scheme} <{want[0]},{want[1]}> SASS: {len(instrs)} instructions, tile loop {len(loop)}"
                     f" ({len(loop) - len(rare)} when no maximum moves){per_token}: "
                     + ", ".join(f"{k} {v}" for k, v in mix.most_common(14)))
        if args.by_line:
            lines.append(f"  where the {len(loop) - len(rare)} come from (instructions, innermost source line):")
            lines += line_costs(cubin, name, [a for a, _ in loop if a not in rare], src, args.by_line)
        if args.sass_dir:
            Path(args.sass_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.sass_dir) / f"{scheme}-{want[0]}-{want[1]}.sass").write_text(
                "\n".join(f"/*{a:04x}*/ {t}" for a, t in instrs) + "\n")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("schemes", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=8)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--instance", default="4,3", help="NW,DEPTH of the instance whose SASS is read (default 4,3)")
    ap.add_argument("--sass-dir", default=None, help="also write that instance's SASS here")
    ap.add_argument("--by-line", type=int, default=0, metavar="N",
                    help="also list the N source lines most instructions of the tile loop's usual path come from")
    ap.add_argument("--reg-cap-warps", type=int, default=None,
                    help="hold registers to this many warps an SM instead of the template's 16 (__launch_bounds__)")
    args = ap.parse_args(argv)
    os.environ.setdefault("KVGEN_CACHE_DIR", tempfile.mkdtemp(prefix="kvgen-sass-"))
    with tempfile.TemporaryDirectory(prefix="kvgen-sass-") as tmp:
        for scheme in args.schemes:
            print("\n".join(analyse(scheme, args, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
