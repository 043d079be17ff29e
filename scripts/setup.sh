#!/usr/bin/env bash
# Create .venv (once) and install kvgen editable with the extras named in $1
# (e.g. "test" or "test,eval"). Chooses the CPU build of PyTorch when the
# machine has no NVIDIA GPU: a plain `pip install torch` would pull a
# multi-GB CUDA build. Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
inputs="pyproject.toml"
[ -f plugins/kvgen-nuq/pyproject.toml ] && inputs="$inputs plugins/kvgen-nuq/pyproject.toml"
# shellcheck disable=SC2086
stamp=".venv/.kvgen-$(cat $inputs | sha256sum | cut -c1-16)-${extras//,/_}"
if [ -f "$stamp" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch
  else
    # The CPU build (on this project's machines it is served from local disk).
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
if [ -d plugins/kvgen-nuq ]; then
  .venv/bin/python -m pip install -q --no-deps -e plugins/kvgen-nuq
fi
touch "$stamp"
