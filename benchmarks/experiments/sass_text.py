"""Reading cuobjdump's text: SASS instructions, loop bodies, register and spill use. Pure text functions (no
Triton, no torch), so a test process can import them without fixing Triton's interpreter mode."""

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


def resource_usage(res_usage: str) -> tuple[int, int]:
    """(registers, spill bytes) from ``cuobjdump -res-usage`` of a one-function cubin. ptxas's spills are the
    STACK frame; LOCAL is other local memory; both count."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", res_usage, re.S)
    if not m:
        raise ValueError(f"no register line in cuobjdump's resource usage: {res_usage[-300:]!r}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))
