"""Every environment variable kvgen honours, read in one place.

This module lives in the runtime because the runtime is shipped inside every
generated package and may import nothing else from kvgen; ``kvgen.env``
re-exports it for the compiler side.

- ``KVGEN_CACHE_DIR``: where compiled packages and autotune results live
  (default ``~/.cache/kvgen``).
- ``KVGEN_PLUGINS``: comma-separated allow-list of entry-point names in the
  ``kvgen.plugins`` group; unset means every installed plugin loads.
- ``TRITON_INTERPRET``: when ``1``, Triton kernels run on the CPU
  interpreter; kvgen then skips autotuning and keeps tensors on the CPU.
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
