"""``python -m kvgen.engine.worker RANK READ_FD WRITE_FD``: a tensor-parallel rank started by rank 0.

Started by :class:`kvgen.engine.parallel.Workers` (never by hand): it reads
its :class:`~kvgen.engine.parallel.RankSpec` and then its steps from
``READ_FD`` and answers on ``WRITE_FD``. A separate module (not
``parallel``), so the classes it unpickles are the ones rank 0 pickled.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    from kvgen.engine.parallel import worker_main

    rank, down, up = (int(a) for a in argv)
    return worker_main(rank, Connection(down, writable=False), Connection(up, readable=False))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
