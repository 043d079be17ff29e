"""Every environment variable kvgen honours, read in one place.

This module lives in the runtime because the runtime is shipped inside every
generated package and may import nothing else from kvgen; ``kvgen.env``
re-exports it for the compiler side.

- ``KVGEN_CACHE_DIR``: where compiled packages and autotune results live
  (default ``~/.cache/kvgen``).
- ``KVGEN_PLUGINS``: comma-separated allow-list of entry-point names in the
  ``kvgen.plugins`` group; unset means every installed plugin loads.
- ``KVGEN_AUTOTUNE``: how kernel configs are chosen per shape bucket:
  ``cached`` (default) uses winners tuned earlier (``kvgen tune``) and
  otherwise a model of the kernel, never timing while a request waits;
  ``sync`` also tunes a new bucket on first use (a few seconds, once), and
  at load times an op's kernels against each other where a package holds
  several (``--backend auto``; ``runtime/backend_choice.py``);
  ``off`` ignores tuned winners and remembered kernel choices too (the
  model's configs and the first kernel only).
- ``KVGEN_WARMUP``: ``0``/``off``/``false`` skips compiling the kernels'
  variants at ``load()`` (default on; CUDA only, see ``runtime/warmup.py``).
- ``TRITON_INTERPRET``: when ``1``, Triton kernels run on the CPU
  interpreter; kvgen then skips autotuning and keeps tensors on the CPU.
- ``KVGEN_PDL``: ``0`` launches every kernel plainly, without programmatic
  dependent launch (the engine's graphs; a split CUDA decode's reduce
  kernel); default on where the GPU has it (sm_90+).
- ``KVGEN_PREFETCH_KB``: KiB of weights each program of the engine's
  projections asks L2 for before its PDL wait (an experiment; unset or 0:
  none).
- ``KVGEN_GEMV``: ``0`` keeps the engine's projections on cuBLAS (no GEMV
  or small GEMM chosen); default on.
- ``KVGEN_FUSED_TORCH``: ``1`` runs the engine's fused elementwise kernels
  as plain torch (comparisons); default off.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of kvgen's on-disk cache (not created here)."""
    raw = os.environ.get("KVGEN_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "kvgen"


def plugin_allow_list() -> frozenset[str] | None:
    """Entry-point names allowed to load, or None when every plugin may load."""
    raw = os.environ.get("KVGEN_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def triton_interpret() -> bool:
    """True when Triton runs kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


AUTOTUNE_MODES = ("cached", "sync", "off")


def autotune_mode() -> str:
    """``KVGEN_AUTOTUNE``: ``cached`` (default), ``sync`` or ``off``."""
    raw = os.environ.get("KVGEN_AUTOTUNE", "").strip().lower()
    if not raw:
        return "cached"
    if raw not in AUTOTUNE_MODES:
        from .errors import KvgenRuntimeError
        raise KvgenRuntimeError(f"KVGEN_AUTOTUNE must be one of {', '.join(AUTOTUNE_MODES)}, got {raw!r}")
    return raw


def gemv_allowed() -> bool:
    """``KVGEN_GEMV``: False when set to ``0`` or empty; default True."""
    return os.environ.get("KVGEN_GEMV", "1") not in ("", "0")


def fused_torch_only() -> bool:
    """``KVGEN_FUSED_TORCH``: True when set to anything but ``0`` or empty; default False."""
    return os.environ.get("KVGEN_FUSED_TORCH", "0") not in ("", "0")


def pdl_allowed() -> bool:
    """``KVGEN_PDL``: False when set to ``0`` or empty; default True (kernels may launch with programmatic dependent
    launch where the device has it)."""
    return os.environ.get("KVGEN_PDL", "1") not in ("", "0")


PREFETCH_SWITCH = "KVGEN_PREFETCH_KB"


def prefetch_bytes() -> int:
    """``KVGEN_PREFETCH_KB`` in bytes: 0 when unset or 0. Raises KvgenRuntimeError unless a whole number."""
    raw = os.environ.get(PREFETCH_SWITCH, "").strip()
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit()):
        from .errors import KvgenRuntimeError
        raise KvgenRuntimeError(f"{PREFETCH_SWITCH} must be a whole number of KiB (0 or unset: no prefetch), "
                                f"got {raw!r}")
    return int(raw) * 1024


def warmup_enabled() -> bool:
    """``KVGEN_WARMUP``: False when set to ``0``, ``off``, ``false`` or ``no``; default True."""
    return os.environ.get("KVGEN_WARMUP", "").strip().lower() not in ("0", "off", "false", "no")
