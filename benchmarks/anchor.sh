#!/usr/bin/env bash
# The anchor side by side (docs/results.md, "The anchor side by side"): speculators' own EAGLE-3 trainer on the same
# hidden states as benchmarks/quality.sh (run it first, with the same OUT and WORKDIR), scored by our evaluator.
# Needs `pip install speculators==0.9.0`. Stages: bash benchmarks/anchor.sh [convert] [train] [eval] (default all).
#   convert: the seeded 1/4 share of our train shards (the subset train.data_fraction picks, so our twin is
#            scaling.json's 1/4 point) and our eval split -> speculators' data folder (benchmarks/anchor_convert.py)
#   train:   speculators' trainer with our recipe's hidden states, draft vocabulary, aux layers [2, 15, 27], 2 epochs,
#            4 unroll steps, 16,384 tokens per batch and our draft's architecture (one Llama layer without its extra
#            norms); its own optimiser, schedule and loss. Its loss runs as its eager implementation: the fused Triton
#            kernel failed inside torch.compile with torch 2.11.
#   eval:    its last checkpoint -> our draft format ($OUT/anchor-draft), scored by eaglepipe.evaluate on our eval
#            split like our draft; $OUT/anchor-acceptance.json and the comparison $OUT/anchor.json.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
W=${WORKDIR:-$OUT/quality}
T=$W/resources/targets/smollm2-135m
A=$OUT/anchor
LAYERS="2 15 27"
[ -f "$W/results/eval/acceptance.json" ] || { echo "$W has no finished workflow: run bash benchmarks/quality.sh" >&2; exit 1; }
mkdir -p "$A"
git rev-parse HEAD > "$OUT/anchor.commit"
for stage in ${@:-convert train eval}; do
    case $stage in
    convert)
        rm -rf "$A/data"
        python benchmarks/anchor_convert.py to-speculators --target "$T" --out "$A/data" --vocab-from "$W/results/draft" \
            --train "$W"/results/hidden_states/train/*.safetensors --val "$W"/results/hidden_states/eval/*.safetensors \
            --data-fraction 0.25 --seed 0
        cp "$A/data/anchor.json" "$OUT/anchor-data.json"
        ;;
    train)
        data=$(python -c "import json; d = json.load(open('$A/data/anchor.json'))
print(d['train_data_ratio'], d['draft_vocab_size'])")
        read -r RATIO VOCAB <<< "$data"
        rm -rf "$A/ckpt"
        start=$SECONDS
        python -m speculators.train --verifier-name-or-path "$T" --data-path "$A/data" --speculator-type eagle3 \
            --save-path "$A/ckpt" --log-dir "$A/ckpt/logs" --train-data-ratio "$RATIO" --draft-vocab-size "$VOCAB" \
            --target-layer-ids $LAYERS --epochs 2 --ttt-steps 4 --total-seq-len 16384 --num-workers 8 \
            --full-attention-indices 0 --log-freq 50 --loss-implementation eager \
            --no-norm-before-fc --no-norm-output --no-norm-before-residual
        echo $((SECONDS - start)) > "$A/train.seconds"
        ;;
    eval)
        last=$A/ckpt/$(ls "$A/ckpt" | grep -E "^[0-9]+$" | sort -n | tail -1)
        rm -rf "$OUT/anchor-draft"
        python benchmarks/anchor_convert.py to-eaglepipe --target "$T" --checkpoint "$last" --aux-layer-ids $LAYERS \
            --out "$OUT/anchor-draft"
        python - "$W" "$OUT" "$last" <<'PY'
import glob, json, os, sys
from eaglepipe.evaluate import run
work, out, last = sys.argv[1:]
ours = json.load(open(f"{work}/results/eval/acceptance.json"))  # the same max_k and eval shards as our draft's score
run(sorted(glob.glob(f"{work}/results/hidden_states/eval/*.safetensors")), f"{out}/anchor-draft",
    f"{out}/anchor-acceptance.json", target_dir=f"{work}/resources/targets/smollm2-135m", max_k=ours["max_k"],
    max_tokens=16384, threads=os.cpu_count(), device="cuda")
anchor = json.load(open(f"{out}/anchor-acceptance.json"))
data = json.load(open(f"{out}/anchor/data/anchor.json"))
twin = next((p for p in json.load(open(f"{out}/scaling.json"))["points"]  # our recipe on the same share
             if abs(p["fraction"] - data["data_fraction"]) < 1e-9), None)
summary = {"anchor": "speculators 0.9.0 (python -m speculators.train)", "checkpoint": last,
           "anchor_offline_tau3": anchor["tau"]["3"], "ours_offline_tau3": ours["tau"]["3"],
           "ours_same_data": twin, "ours_same_data_tau3": twin and twin["tau"]["3"],
           "anchor_tau": anchor["tau"], "ours_tau": ours["tau"], "positions": anchor["positions"],
           "ours_positions": ours["positions"], "train_tokens": data["tokens"]["train"],
           "anchor_train_seconds": int(open(f"{out}/anchor/train.seconds").read()), "data": data}
json.dump(summary, open(f"{out}/anchor.json", "w"), indent=2)
print(json.dumps({k: summary[k] for k in ("anchor_offline_tau3", "ours_same_data_tau3", "ours_offline_tau3",
                                          "anchor_train_seconds")}))
PY
        ;;
    *)
        echo "usage: bash benchmarks/anchor.sh [convert] [train] [eval]" >&2
        exit 2
        ;;
    esac
done
