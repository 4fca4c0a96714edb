#!/usr/bin/env bash
# The quality recipe on one GPU (docs/results.md, "A draft worth serving" and "Data scaling"):
# config/examples/h200-quality.yaml from prompts to offline acceptance in the workflow directory $WORKDIR (default
# $OUT/quality; ~41 GB of hidden states), then its draft bundle and tau against training tokens. An interrupted run
# resumes where it stopped when started again. Writes $OUT/quality-acceptance.json (eval split: tau greedy, at
# T = 0.7, by position), $OUT/quality-mtbench.json (MT-Bench tau per category), $OUT/quality-trace-stats.json,
# $OUT/draft-bundle/, and with SCALING=1 (the default) $OUT/scaling.json and $OUT/scaling.png; per-job times stay in
# $WORKDIR/benchmarks/.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
W=${WORKDIR:-$OUT/quality}
C="config/config.yaml config/examples/h200-quality.yaml"
echo "${EAGLEPIPE_COMMIT:-$(git rev-parse HEAD)}" > "$OUT/quality.commit"
start=$SECONDS
# --keep-going: a failed benchmark set (say, an MT-Bench question among the synthesized prompts) leaves the eval split's
# figure to finish; the run still exits non-zero, naming the failed job.
snakemake -d "$W" --cores all --resources gpu=1 --scheduler greedy --rerun-incomplete --keep-going \
    results/eval/acceptance.json results/traces/stats.json results/benchmarks/mtbench/acceptance.json --configfile $C
echo "workflow: $((SECONDS - start)) s"
cp "$W/results/eval/acceptance.json" "$OUT/quality-acceptance.json"
cp "$W/results/traces/stats.json" "$OUT/quality-trace-stats.json"
cp "$W/results/benchmarks/mtbench/acceptance.json" "$OUT/quality-mtbench.json"
rm -rf "$OUT/draft-bundle"
python -m eaglepipe.bundle --directory "$W" --out "$OUT/draft-bundle"
[ "${SCALING:-1}" = 1 ] || exit 0
python -m eaglepipe.tools.scaling --directory "$W" --configfile $C --fractions 0.125,0.25,0.5 \
    --json "$OUT/scaling.json" --plot "$OUT/scaling.png"
