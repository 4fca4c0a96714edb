#!/usr/bin/env bash
# Draft training on one GPU (docs/results.md, "Draft training on one GPU"): the bf16 training step on random hidden
# states for a SmolLM2-shaped draft in the quality recipe's shape (32K draft vocabulary, 4 unroll steps, 32,768-token
# batches) and a Kimi-K2-shaped draft (against the naive bf16 path and the fp32 reference), each eager and with the
# compiled steps (train.compile) in the same run, with start-up seconds and where a step's time goes; the SmolLM2 shape
# also through speculators' own training step (--anchor; pip install speculators==0.9.0, or ANCHOR=0 to leave it
# out). Writes $OUT/gpu-training-smollm2.json and $OUT/gpu-training-kimi.json.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
echo "${EAGLEPIPE_COMMIT:-$(git rev-parse HEAD)}" > "$OUT/training.commit"
python -m eaglepipe.tools.bench_train --preset smollm2-135m --device cuda --draft-vocab 32000 --tokens 32768 \
    --seq-len 1024 --ttt-steps 4 --steps 10 --no-baseline --compile --profile 20 $([ "${ANCHOR:-1}" = 1 ] && echo --anchor) \
    --json "$OUT/gpu-training-smollm2.json"
python -m eaglepipe.tools.bench_train --preset kimi-k2 --device cuda --tokens 4096 --seq-len 2048 --ttt-steps 7 \
    --steps 3 --compile --profile 20 --json "$OUT/gpu-training-kimi.json"
