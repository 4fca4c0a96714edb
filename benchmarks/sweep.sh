#!/usr/bin/env bash
# The draft-variant sweep on one GPU: the quality recipe (config/examples/h200-quality.yaml) with the variants of
# config/examples/sweep.yaml, each trained as its own job on the recipe's hidden states in the workflow directory
# $WORKDIR (default $OUT/quality, the one benchmarks/quality.sh fills: its traces and hidden states are reused, and a
# run from nothing makes them first). Three passes: the baseline variant (recipe) first, so its figures come before
# the sweep's; every variant, one factor at a time; then, with COMBINE=1 (the default), one variant combining those
# that beat the baseline (python -m eaglepipe.tools.combine_variants), trained and compared with the others. An
# interrupted run resumes where it stopped when started again. Writes $OUT/sweep.json: device, command, commit, the
# winner and, per variant, its overrides, offline tau (k = 1..5, greedy, eval split), tau at k = 3 at T = 0.7,
# outside trailing loops and on MT-Bench, training tokens and seconds (eaglepipe/variants.py documents the rows);
# $OUT/sweep-variants.png, the winner's $OUT/sweep-acceptance.json and its bundle $OUT/sweep-bundle/, and after the
# first pass the recipe's bundle $OUT/recipe-bundle/.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
W=${WORKDIR:-$OUT/quality}
C="config/config.yaml config/examples/h200-quality.yaml config/examples/sweep.yaml"
RUN="snakemake -d $W --cores all --resources gpu=1 --scheduler greedy --rerun-incomplete --keep-going"
COMMIT=${EAGLEPIPE_COMMIT:-$(git rev-parse HEAD)}
echo "$COMMIT" > "$OUT/sweep.commit"
start=$SECONDS
# --keep-going: a variant that fails (say, out of memory) leaves the others to finish; the run still exits non-zero.
$RUN results/drafts/recipe/acceptance.json results/drafts/recipe/benchmarks/mtbench/acceptance.json \
    results/traces/stats.json --configfile $C
BASELINE_S=$((SECONDS - start))
echo "baseline variant (the recipe, prompts to its figures): $BASELINE_S s"
rm -rf "$OUT/recipe-bundle"
python -m eaglepipe.bundle --directory "$W" --variant recipe --out "$OUT/recipe-bundle"
$RUN results/variants/variants.json --configfile $C
ONE_FACTOR_S=$((SECONDS - start))
echo "one factor at a time: $ONE_FACTOR_S s"
cp "$W/results/variants/variants.json" "$OUT/sweep-variants-one-factor.json"
if [ "${COMBINE:-1}" = 1 ]; then
    rm -f "$OUT/sweep-combined.yaml"
    python -m eaglepipe.tools.combine_variants --table "$W/results/variants/variants.json" --out "$OUT/sweep-combined.yaml"
    if [ -f "$OUT/sweep-combined.yaml" ]; then C="$C $OUT/sweep-combined.yaml"; fi
fi
CMD="$RUN results/variants/variants.json results/eval/acceptance.json --configfile $C"
$CMD
WORKFLOW_S=$((SECONDS - start))
echo "workflow: $WORKFLOW_S s"
cp "$W/results/variants/variants.json" "$OUT/sweep-variants.json"
cp "$W/results/report/variants.png" "$OUT/sweep-variants.png"
cp "$W/results/eval/acceptance.json" "$OUT/sweep-acceptance.json"
rm -rf "$OUT/sweep-bundle"
python -m eaglepipe.bundle --directory "$W" --out "$OUT/sweep-bundle"
export COMMIT CMD BASELINE_S ONE_FACTOR_S WORKFLOW_S
python - "$OUT" <<'PY'
import json, os, shutil, subprocess, sys

out = sys.argv[1]
table = json.load(open(f"{out}/sweep-variants.json"))
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True) \
    if shutil.which("nvidia-smi") else None
k = str(table["k"])
rows = [{"name": r["name"], "overrides": r["overrides"], "offline_tau": r["tau"],
         "offline_tau3_t0.7": r["tau_at"].get("0.7"), "mtbench_tau3": r["benchmarks"].get("mtbench"),
         "offline_tau3_outside_loops": r["outside_loops_tau"], "train_tokens": r["train_tokens"],
         "train_seconds": r["train_seconds"]} for r in table["variants"]]
sweep = {"device": gpu.stdout.strip().splitlines()[0] if gpu and gpu.returncode == 0 else "unknown",
         "command": os.environ["CMD"], "commit": os.environ["COMMIT"], "k": table["k"],
         "criterion": table["criterion"], "winner": table["winner"],
         "seconds": {"baseline_pass": int(os.environ["BASELINE_S"]),
                     "one_factor_pass": int(os.environ["ONE_FACTOR_S"]), "workflow": int(os.environ["WORKFLOW_S"]),
                     "note": "wall time from the start of the first pass (the baseline pass includes the data)"},
         "combined": next((r["overrides"] for r in rows if r["name"] == "combined"), None), "variants": rows}
json.dump(sweep, open(f"{out}/sweep.json", "w"), indent=2)
for r in rows:
    print(f"{r['name']:>20}: tau({k}) {r['offline_tau'][k]:.3f}  T=0.7 {r['offline_tau3_t0.7'] or float('nan'):.3f}  "
          f"outside loops {r['offline_tau3_outside_loops']:.3f}  MT-Bench {r['mtbench_tau3'] or float('nan'):.3f}  "
          f"{r['train_seconds'] / 60:.1f} min")
print(f"winner: {table['winner']}")
PY
