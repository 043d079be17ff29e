#!/usr/bin/env bash
# The diagnostics behind README.md's "Why the misses" (run from the repository root, after run.sh).
set -euo pipefail
OUT=benchmarks/results/2026-11-29-eval-cpu
SHAKE="--fetch smollm2 --text ../shared/data/text/tinyshakespeare.txt --window 1024 --max-tokens 16384 --backend reference --threads 1"

# int2/int4 on windows 0-1: kvgen's order (convert, then attend) vs KIVI's (attend, then convert).
.venv/bin/kvgen eval $SHAKE --kv int4,int2 --windows 0:2 \
    --json-out $OUT/diag-smollm2-default-order.windows-0-2.json \
    > $OUT/diag-smollm2-default-order.windows-0-2.txt 2> $OUT/diag-smollm2-default-order.windows-0-2.log
.venv/bin/kvgen eval $SHAKE --kv int4,int2 --windows 0:2 --convert-after-attention \
    --json-out $OUT/diag-smollm2-convert-after-attention.windows-0-2.json \
    > $OUT/diag-smollm2-convert-after-attention.windows-0-2.txt 2> $OUT/diag-smollm2-convert-after-attention.windows-0-2.log
.venv/bin/kvgen eval --model-path ../shared/data/models/stories260K --text ../shared/data/text/tinystories_valid_first22.txt \
    --kv int4,int2 --window 512 --backend reference --threads 1 --convert-after-attention \
    --json-out $OUT/diag-stories260K-convert-after-attention.json \
    > $OUT/diag-stories260K-convert-after-attention.txt 2> $OUT/diag-stories260K-convert-after-attention.log

# Keys vs values, layer ranges, K/V outlier statistics: window 0 of SmolLM2 (kvgen's order).
.venv/bin/python $OUT/diagnose.py --smollm2 --text ../shared/data/text/tinyshakespeare.txt --window 1024 \
    --max-tokens 16384 --windows 0:1 --rows int2:k,int2:v,int2@0-9,int2@10-19,int2@20-29,fp8:k,fp8:v --stats \
    --json-out $OUT/diag-smollm2-parts.window-0.json > $OUT/diag-smollm2-parts.window-0.txt 2> $OUT/diag-smollm2-parts.window-0.log
