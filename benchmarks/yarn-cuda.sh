#!/usr/bin/env bash
# A Kimi-K2-rope target on CUDA (docs/results.md, "A Kimi-K2-rope target on CUDA"): a tiny DeepSeek-V3 (MLA + MoE)
# with Kimi-K2's yarn rope keys (factor 32), the workflow from prompts to offline acceptance with the transformers
# engine and training on CUDA, timed from a fresh directory $OUT/yarn-cuda. Writes $OUT/yarn-cuda.json (wall seconds,
# offline acceptance) and $OUT/yarn-cuda-train.log. Same bytes on a forced rerun and on resume after a kill:
# tests/test_gpu_yarn.py.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)   # the config names the target by its absolute path
T=resources/targets/smollm2-135m
Y=$OUT/yarn-cuda
git rev-parse HEAD > "$OUT/yarn-cuda.commit"
[ -f $T/config.json ] || snakemake --cores 1 $T
rm -rf "$Y" && mkdir -p "$Y"
python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; import tiny_targets
tiny_targets.kimi_rope(Path('$Y/target'), Path('$T'))"
cat > "$Y/config.yaml" <<Y
target: {name: tiny-kimi-rope, path: $Y/target}
engine: {name: transformers, device: cuda, dtype: bfloat16, batch_size: 32, gpus: 1}
prompts: {max_prompts: 160}
generation: {max_new_tokens: 64, num_shards: 2, chunk_size: 16}
vocab: {draft_vocab_size: 4096}
train: {device: cuda, gpus: 1, epochs: 6, ttt_steps: 3, checkpoint_every: 10, log_every: 10}
Y
start=$SECONDS
snakemake --cores all -d "$Y/work" results/eval/acceptance.json --configfile config/config.yaml "$Y/config.yaml"
seconds=$((SECONDS - start))
cp "$Y/work/logs/train.log" "$OUT/yarn-cuda-train.log"
python -c "import json; print(json.dumps({'workflow_seconds': $seconds,
    'acceptance': json.load(open('$Y/work/results/eval/acceptance.json'))}, indent=2))" > "$OUT/yarn-cuda.json"
