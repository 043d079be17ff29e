"""``python -m kvgen.serve --model PATH ...``: the ``kvgen serve`` command on its own."""

from __future__ import annotations

import argparse
import sys

from kvgen.errors import KvgenError

from .cli import HELP, add_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgen.serve", description=HELP)
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KvgenError as e:
        print(f"kvgen serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
