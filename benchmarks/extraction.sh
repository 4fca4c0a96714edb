#!/usr/bin/env bash
# Extraction to shards on one GPU (docs/results.md, "Extraction on one GPU"): the embedded target, then a
# Llama-3.1-8B-shaped target (random weights) at two shard sizes, 1M tokens (32 GB, a production shard's size) and
# 250K tokens (8 GB). The shards and the disk probe go to $OUT/bench-out: put OUT on the disk the shards would use.
# Writes $OUT/gpu-extraction-smollm2.json and $OUT/gpu-extraction-llama8b-shard{1000000,250000}.json.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
T=resources/targets/smollm2-135m
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/extraction.commit"
[ -f $T/config.json ] || snakemake --cores 1 $T
python -m eaglepipe.tools.bench_extraction --target $T --device cuda --tokens 4000000 --baseline-tokens 1000000 \
    --chunk-size 256 --out "$OUT/bench-out" --json "$OUT/gpu-extraction-smollm2.json"
for shard in 1000000 250000; do
    python -m eaglepipe.tools.bench_extraction --preset llama-8b --device cuda --tokens 1000000 \
        --baseline-tokens 250000 --shard-tokens $shard --out "$OUT/bench-out" --max-batch-tokens 16384 \
        --json "$OUT/gpu-extraction-llama8b-shard$shard.json"
done
