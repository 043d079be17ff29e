"""Reading cuobjdump's and nvdisasm's text: SASS instructions, loop bodies, the branch a loop skips its rare part
with, source lines of instructions, register and spill use. Pure text functions (no Triton, no torch), so a test
process can import them without fixing Triton's interpreter mode."""

from __future__ import annotations

import re

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line of ``cuobjdump -sass`` output, in code order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: "@!P0 LDGSTS.E.BYPASS.128 [R1], ..." -> "LDGSTS"."""
    return _PREDICATE.sub("", instruction).split()[0].split(".")[0]


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of every loop (a branch back to an earlier address, through the branch), in code order."""
    lines = instructions(sass)
    bodies = []
    for addr, ins in lines:
        target = re.search(r"0x([0-9a-f]+)", ins) if opcode(ins) == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            bodies.append([x for a, x in lines if start <= a <= addr])
    return bodies


def skipped_by_vote(loop: list[tuple[int, str]]) -> set[int]:
    """Addresses of ``loop`` (``(address, instruction)``, code order) that the first forward branch after its first
    ``VOTE.ANY`` jumps over: the body of a warp-uniform branch taken only when some lane votes for it (the CUDA
    decode's lazy rescale). Empty where the loop has no such vote and branch."""
    vote = next((i for i, (_, ins) in enumerate(loop) if opcode(ins) == "VOTE"), None)
    if vote is None:
        return set()
    for addr, ins in loop[vote:]:
        target = re.search(r"0x([0-9a-f]+)", ins) if opcode(ins) == "BRA" else None
        if target and int(target.group(1), 16) > addr:
            end = int(target.group(1), 16)
            return {a for a, _ in loop if addr < a < end}
    return set()


_FILE_LINE = re.compile(r'\s*//## File "([^"]*)", line (\d+)((?: inlined at "[^"]*", line \d+)*)')
_INLINED_AT = re.compile(r'inlined at "([^"]*)", line (\d+)')
_NVDISASM = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def source_lines(nvdisasm_text: str, function: str) -> dict[int, list[tuple[str, int]]]:
    """Address -> source lines ``(file, line)`` of each instruction of ``function`` in ``nvdisasm -gi`` output of a
    cubin built with ``-lineinfo``: the line the instruction was compiled from first (a CUDA header's, for an
    intrinsic), then each line it was inlined at, outward (the function's own body last)."""
    out: dict[int, list[tuple[str, int]]] = {}
    inside, chain, fresh = False, [], False
    for line in nvdisasm_text.splitlines():
        if line.startswith(".text."):
            inside = line[len(".text."):].rstrip(":") == function
            chain, fresh = [], False
            continue
        if not inside:
            continue
        if (m := _FILE_LINE.match(line)):
            # a run of "//## File" lines before an instruction: the first names the innermost frame, and each
            # names the line its frame was inlined at ("line 730 inlined at ..., line 752", then "line 752 ...")
            if not fresh:
                chain, fresh = [(m.group(1), int(m.group(2)))], True
            chain += [(f, int(n)) for f, n in _INLINED_AT.findall(m.group(3))]
            continue
        if (m := _NVDISASM.match(line)):
            out[int(m.group(1), 16)] = chain
            fresh = False
    return out


def resource_usage(res_usage: str) -> tuple[int, int]:
    """(registers, spill bytes) from ``cuobjdump -res-usage`` of a one-function cubin. ptxas's spills are the
    STACK frame; LOCAL is other local memory; both count."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", res_usage, re.S)
    if not m:
        raise ValueError(f"no register line in cuobjdump's resource usage: {res_usage[-300:]!r}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))
