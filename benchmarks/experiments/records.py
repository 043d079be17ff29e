"""One experiment's JSON: its records with the date, GPU and versions they were measured on, written atomically.

Experiments that rewrite the file after every record (so that a cut run keeps what it measured) call
:func:`write_records` each time; kvgen's :func:`kvgen.atomic.write_atomic` does the writing.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from kvgen.atomic import write_atomic


def write_records(path: str | Path, records: list, **extra) -> None:
    """``{"date", "gpu", "torch", "triton", **extra, "records"}`` into ``path`` (UTC date; the current CUDA device's
    name; values JSON cannot hold written as strings)."""
    import torch
    import triton

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, **extra, "records": records}
    write_atomic(path, json.dumps(doc, indent=1, default=str))
