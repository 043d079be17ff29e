"""``python -m kvgen.serve --model PATH ...``: the ``kvgen serve`` command itself.

It runs through kvgen's CLI, so it behaves as ``kvgen serve`` does: the
Triton interpreter on a machine without a GPU, one line and exit code 2
for a user's mistake.
"""

from __future__ import annotations

import sys

from kvgen.cli import main as _cli_main


def main(argv: list[str] | None = None) -> int:
    return _cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
