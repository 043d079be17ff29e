#!/usr/bin/env bash
# Create .venv (once) and install kvgen editable, quietly, with the extras named in
# $1 (e.g. "test" or "test,eval"), plus the kvgen-nuq plugin.
#
# Without an NVIDIA GPU the set-up ends with the CPU build of PyTorch: a plain
# `pip install torch` on Linux pulls a multi-GB CUDA build. The CPU build comes
# from PyTorch's CPU wheel index when that answers within a few seconds, else
# from the ordinary package index (some machines, this project's among them,
# serve the CPU build there from local disk). With a GPU, pip's default build.
#
# -qq: pip 26 prints setuptools' informational notes ("Editable installation") at -q;
# errors still show.
#
# Re-running is cheap: a stamp in .venv records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python="${PYTHON:-python3}"
torch_cpu="torch==2.13.0"                         # the CPU build CI tests with
torch_cpu_index="https://download.pytorch.org/whl/cpu"

pip() { .venv/bin/python -m pip "$@"; }

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
echo "setup: installing kvgen[$extras] into .venv (once; a few minutes)" >&2
pip install -qq --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -qq "torch>=2.11,<3"
  elif ! pip install -qq --timeout 5 --retries 0 --index-url "$torch_cpu_index" "$torch_cpu" 2>/dev/null; then
    echo "setup: PyTorch's CPU wheel index did not answer; $torch_cpu from the package index" >&2
    pip install -qq "$torch_cpu"
  fi
fi
pip install -qq -e ".[${extras}]"
if [ -d plugins/kvgen-nuq ]; then
  pip install -qq --no-deps -e plugins/kvgen-nuq
fi
touch "$stamp"
