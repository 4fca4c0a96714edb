#!/usr/bin/env bash
# Generation on one GPU (docs/results.md, "Generation on one GPU"): the transformers engine's fast path against
# model.generate on the embedded target in bf16, 2,440 prompts x 256 new tokens. Writes $OUT/gpu-generation.json.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
T=resources/targets/smollm2-135m
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/generation.commit"
[ -f $T/config.json ] || snakemake --cores 1 $T
python -m eaglepipe.tools.bench_generation --target $T --device cuda --dtype bfloat16 --max-new-tokens 256 \
    --repeat 4 --baseline-prompts 256 --json "$OUT/gpu-generation.json"
