#!/usr/bin/env bash
# kvgen eval with the fresh-prompt protocol (a prefill attends its own tokens from their fresh
# K/V; decode steps read the quantized pages), CPU, reference backend. Run from the repo root.
# nuq4 uses a codebook fitted on SmolLM2 over TinyStories text (not the evaluated text):
#   kvgen nuq calibrate --model-path ~/.cache/kvgen/models/smollm2-135m-instruct \
#       --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --text ../shared/data/text/tinystories_valid_first22.txt \
#       --out $R/smollm2-135m-tinystories.json --page-sizes 16
set -euo pipefail
R=benchmarks/results/2026-11-29-eval-cpu-fresh
KV=fp16,bf16,int8,fp8,int4,int2,nuq4
for w in 0:8 8:16; do
  KVGEN_NUQ_CODEBOOK=$PWD/$R/smollm2-135m-tinystories.json \
  .venv/bin/kvgen eval --fetch smollm2 --text ../shared/data/text/tinyshakespeare.txt --kv $KV \
      --window 1024 --max-tokens 16384 --backend reference --threads 1 --windows $w \
      --json-out $R/smollm2.windows-${w/:/-}.json > $R/smollm2.windows-${w/:/-}.txt 2> $R/smollm2.windows-${w/:/-}.log &
done
wait
.venv/bin/kvgen eval --merge $R/smollm2.windows-0-8.json $R/smollm2.windows-8-16.json --json-out $R/smollm2.json > $R/smollm2.txt
# stories260K: nuq4 with its shipped default codebook (fitted on stories260K over TinyStories)
.venv/bin/kvgen eval --model-path ../shared/data/models/stories260K --text ../shared/data/text/tinystories_valid_first22.txt \
    --kv $KV --window 512 --backend reference --threads 1 --json-out $R/stories260K.json > $R/stories260K.txt 2> $R/stories260K.log
