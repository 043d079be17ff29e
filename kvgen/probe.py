"""``kvgen probe``: measure this GPU's host link and device copy bandwidth, and store it for ``--target auto``.

What is measured (bytes/s, each the median of ``repeats`` timed runs after a warm-up):

- ``host_to_device_bandwidth`` / ``device_to_host_bandwidth``: pinned host
  memory to/from device memory, in large copies (:data:`LARGE_SIZES`); the
  figure is the median over those sizes. The planner's host-tier step time
  uses the host-to-device figure (cold KV streams to the GPU).
- ``chunks``: the same two directions in the chunk sizes the host tier moves
  (:data:`CHUNK_SIZES`: one run of pages of one layer and tensor is a few
  KiB to a few MiB), many chunks queued and then waited for, as the runtime does.
- ``device_copy_bandwidth``: device-to-device copy, bytes copied per second
  (each byte is read once and written once, so memory traffic is twice this).

The result is written atomically to ``cache_dir()/probe/<device-slug>.json``
with the torch, CUDA and driver versions and the date; :func:`load_probe`
reads it back without importing torch (``kvgen plan --target auto`` uses it).
The timing core (:func:`median_bandwidth`, :func:`measure`) takes the copy
function and the timer as arguments, so it is tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvgen.errors import KvgenError

MiB = 2**20
KiB = 2**10
LARGE_SIZES = (64 * MiB, 256 * MiB)
CHUNK_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
CHUNK_BATCH_BYTES = 64 * MiB  # chunks queued per timed run (as many as fit, at most MAX_CHUNKS)
MAX_CHUNKS = 1024
REPEATS = 5
FORMAT = 1
DIRECTIONS = ("h2d", "d2h")


class ProbeError(KvgenError):
    """``kvgen probe`` cannot run here (no CUDA GPU), or a stored probe is unusable."""


def median_bandwidth(copy: Callable[[], None], nbytes: int, timer: Callable[[], float] = time.perf_counter,
                     repeats: int = REPEATS) -> float:
    """Bytes/s of ``copy`` (moves ``nbytes`` and returns once they have arrived): the median of ``repeats`` runs.

    One untimed warm-up run first (allocation, first-touch and launch costs are
    not the link's). A run timed at zero seconds is a broken timer: ProbeError.
    """
    copy()
    rates = []
    for _ in range(repeats):
        t0 = timer()
        copy()
        dt = timer() - t0
        if dt <= 0:
            raise ProbeError(f"a {nbytes:,}-byte copy was timed at {dt} s; the timer is not usable")
        rates.append(nbytes / dt)
    return float(statistics.median(rates))


def chunk_count(size: int) -> int:
    """How many ``size``-byte chunks one timed run queues: enough to hide per-copy launch gaps, bounded."""
    return max(1, min(MAX_CHUNKS, CHUNK_BATCH_BYTES // size))


def measure(make_copy: Callable[[str, int, int], Callable[[], None]], timer: Callable[[], float] = time.perf_counter,
            repeats: int = REPEATS, large_sizes: Sequence[int] = LARGE_SIZES,
            chunk_sizes: Sequence[int] = CHUNK_SIZES) -> dict[str, Any]:
    """The figures of the module docstring. ``make_copy(kind, size, count)`` returns a function that does
    ``count`` copies of ``size`` bytes of ``kind`` (``h2d``, ``d2h`` or ``d2d``) and waits for them."""
    large = {k: {s: median_bandwidth(make_copy(k, s, 1), s, timer, repeats) for s in large_sizes}
             for k in (*DIRECTIONS, "d2d")}
    chunks = {k: {s: median_bandwidth(make_copy(k, s, chunk_count(s)), s * chunk_count(s), timer, repeats)
                  for s in chunk_sizes} for k in DIRECTIONS}
    return {
        "host_to_device_bandwidth": float(statistics.median(large["h2d"].values())),
        "device_to_host_bandwidth": float(statistics.median(large["d2h"].values())),
        "device_copy_bandwidth": float(statistics.median(large["d2d"].values())),
        # JSON keys are strings: the chunk size in bytes.
        "large": {k: {str(s): v for s, v in d.items()} for k, d in large.items()},
        "chunks": {k: {str(s): v for s, v in d.items()} for k, d in chunks.items()},
    }


# -- storage -----------------------------------------------------------------
def device_slug(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: a file name safe on every system."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"


def probe_path(device_name: str) -> Path:
    """Where the probe of a device named ``device_name`` is stored (under KVGEN_CACHE_DIR)."""
    from kvgen.env import cache_dir

    return cache_dir() / "probe" / f"{device_slug(device_name)}.json"


def save_probe(result: dict[str, Any]) -> Path:
    """Write ``result`` (with its ``device`` name) atomically to :func:`probe_path`; returns the path."""
    from kvgen.atomic import write_atomic

    path = probe_path(result["device"])
    write_atomic(path, json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def _valid(result: Any, device_name: str) -> bool:
    if not isinstance(result, dict) or result.get("format") != FORMAT or result.get("device") != device_name:
        return False
    if not isinstance(result.get("date"), str):
        return False
    return all(isinstance(result.get(k), (int, float)) and math.isfinite(result[k]) and result[k] > 0
               for k in ("host_to_device_bandwidth", "device_to_host_bandwidth", "device_copy_bandwidth"))


def load_probe(device_name: str) -> dict[str, Any] | None:
    """The stored probe of ``device_name``, or None when there is none or it is unreadable/not for this device.

    No torch: the planner reads it on ``--target auto``. A damaged file is
    ignored (the preset figure stands in, and the plan says it was not
    measured); running ``kvgen probe`` again replaces it.
    """
    try:
        result = json.loads(probe_path(device_name).read_text())
    except (OSError, ValueError):
        return None
    return result if _valid(result, device_name) else None


# -- the command ---------------------------------------------------------------
def _driver_version() -> str | None:
    """The CUDA driver's version (e.g. ``"12.4"``) through libcuda, None where that is not available."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{v.value // 1000}.{v.value % 1000 // 10}"


def _torch_copier(torch: Any) -> Callable[[str, int, int], Callable[[], None]]:
    def make_copy(kind: str, size: int, count: int) -> Callable[[], None]:
        dev = torch.empty(size * count, dtype=torch.uint8, device="cuda")
        other = (torch.empty_like(dev) if kind == "d2d"
                 else torch.empty(size * count, dtype=torch.uint8, pin_memory=True))
        src, dst = (other, dev) if kind in ("h2d", "d2d") else (dev, other)
        pieces = [(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size]) for i in range(count)]

        def copy() -> None:
            for d, s in pieces:
                d.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
        return copy
    return make_copy


def run_probe(repeats: int = REPEATS) -> dict[str, Any]:
    """Measure device 0 with torch.cuda; the result, ready for :func:`save_probe`. ProbeError without a GPU."""
    import torch  # deferred: only this command needs it

    if not torch.cuda.is_available():
        raise ProbeError("kvgen probe needs a CUDA GPU (torch sees none); run it on the machine that will serve, "
                         "or plan with a named --target")
    name = str(torch.cuda.get_device_properties(0).name)
    figures = measure(_torch_copier(torch), repeats=repeats)
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"format": FORMAT, "device": name, "date": now.date().isoformat(), "measured_at": now.isoformat(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": _driver_version(),
            "repeats": repeats, **figures}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"timed runs per size, median taken (default {REPEATS})")


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ProbeError(f"--repeats must be at least 1, got {args.repeats}")
    result = run_probe(args.repeats)
    path = save_probe(result)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['device']}: host->device {result['host_to_device_bandwidth'] / 1e9:.1f} GB/s, "
          f"device->host {result['device_to_host_bandwidth'] / 1e9:.1f} GB/s, "
          f"device copy {result['device_copy_bandwidth'] / 1e9:.1f} GB/s")
    for kind in DIRECTIONS:
        sizes = ", ".join(f"{int(s) // KiB} KiB {v / 1e9:.1f}" for s, v in result["chunks"][kind].items())
        print(f"  {kind} in chunks (GB/s): {sizes}")
    print(f"stored in {path}; kvgen plan --target auto uses it")
    return 0
