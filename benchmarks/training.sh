#!/usr/bin/env bash
# Draft training on one GPU (docs/results.md, "Draft training on one GPU"): the bf16 training step on random hidden
# states for a Kimi-K2-shaped draft (against the naive bf16 path and the fp32 reference) and a SmolLM2-shaped draft
# with a 32K draft vocabulary. Writes $OUT/gpu-training-kimi.json and $OUT/gpu-training-smollm2.json.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/training.commit"
python -m eaglepipe.tools.bench_train --preset kimi-k2 --device cuda --tokens 4096 --seq-len 2048 --ttt-steps 7 \
    --steps 3 --json "$OUT/gpu-training-kimi.json"
python -m eaglepipe.tools.bench_train --preset smollm2-135m --device cuda --draft-vocab 32000 --tokens 16384 \
    --seq-len 512 --ttt-steps 7 --steps 5 --no-baseline --json "$OUT/gpu-training-smollm2.json"
