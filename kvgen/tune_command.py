"""``kvgen tune``: time a compiled package's kernels ahead of time, so serving never tunes on a request's path.

``kvgen tune PACKAGE_DIR --batch 1,32 --context 4096,32768 [--prefill-tokens N] [--retune]``
loads the package's runtime on the current GPU with one layer and enough
pages for the largest shape, tunes each (batch, context) bucket (decode, and
prefill over ``--prefill-tokens``-token chunks), and persists the winners
where every later ``load()`` of the same kernels finds them (the autotune
cache under ``KVGEN_CACHE_DIR``). Imports torch only when run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kvgen.errors import KvgenError


class TuneError(KvgenError):
    """``kvgen tune`` was pointed at something that is not a compiled package, or given bad sizes."""


def _sizes(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise TuneError(f"{flag} takes positive integers separated by commas (e.g. 1,32), got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("package", help="a folder written by kvgen compile")
    p.add_argument("--batch", default="1,32", help="batch sizes, comma-separated (default 1,32)")
    p.add_argument("--context", default="4096", help="context lengths in tokens, comma-separated (default 4096)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="tokens per prefill chunk to tune (default: the context)")
    p.add_argument("--ops", default="decode,prefill", help="ops to tune (default decode,prefill)")
    p.add_argument("--retune", action="store_true", help="time again even where a winner is stored")


def run(args: argparse.Namespace) -> int:
    batches, contexts = _sizes(args.batch, "--batch"), _sizes(args.context, "--context")
    folder = Path(args.package)
    if not (folder / "manifest.json").is_file():
        raise TuneError(f"{folder} is not a kvgen package (no manifest.json); pass a folder written by kvgen compile")
    from kvgen.codegen.package import import_package

    pkg = import_package(folder)
    shapes = list(itertools.product(batches, contexts))
    cache = pkg.load(max_tokens=max(b * c for b, c in shapes) + 64 * max(batches), num_layers=1, max_seqs=max(batches))
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    records = pkg.runtime.autotune.tune(cache, shapes, ops=ops, prefill_tokens=args.prefill_tokens,
                                        retune=args.retune)
    for r in records:
        if getattr(args, "json", False):
            print(json.dumps(r, default=str))
        else:
            backend = f"{r['backend']:6s} " if r.get("backend") else ""
            print(f"{r['op']:8s} {backend}{r['key']:28s} {r.get('ms') or float('nan'):8.4f} ms  {r['config']}  "
                  f"({r.get('candidates')} candidates, {r.get('seconds', 0):.1f} s)")
    if not getattr(args, "json", False):
        for op, choice in sorted((getattr(cache, "backend_choices", None) or {}).items()):
            print(f"{op:8s} runs {choice.why}")  # --backend auto: which variant the runtime chose, and why
    return 0
