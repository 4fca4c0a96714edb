# The anchor side by side (issue 12 item 6): speculators' own EAGLE-3 trainer (vllm-project/speculators 0.9.0, the
# newest on the package index) on the SAME hidden states as the h200-quality workflow, scored by our evaluator
# (eaglepipe.evaluate) and served by vLLM like our draft. Run after `bash tests/gpu/h200.sh quality` on the same warm
# machine (it reads /root/w). One stage per device call:
#   bash tests/gpu/anchor_speculators.sh setup    # carry .whl-anchor: speculators + the 15 wheels the image lacks
#   bash tests/gpu/anchor_speculators.sh convert  # our shards -> speculators' data folder (tests/gpu/anchor_convert.py)
#   bash tests/gpu/anchor_speculators.sh train    # speculators train; rerun if it stops at the time limit (it resumes)
#   bash tests/gpu/anchor_speculators.sh eval     # its checkpoint -> our draft format; our evaluator on our eval split
#   bash tests/gpu/anchor_speculators.sh native   # optional: speculators' default architecture (extra norms), vLLM only
# Wheels, made on the CPU machine (pure Python except jiter and pydantic-core, cp312 manylinux2014; 6.9 MB in all):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-anchor \
#     speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 openai==3.57.0 \
#     httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 loguru==0.7.3 \
#     pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
#     typing-inspection==0.4.5
# Everything else speculators needs (torch 2.11, transformers 5.17, triton, safetensors, numpy, pyarrow, pandas,
# huggingface-hub, rich, typer, ...) is in the image. speculators imports no vLLM in training (only its data-generation
# client talks to a vLLM server; hidden states already on disk are read from files).
#
# What is kept equal to our recipe (config/examples/h200-quality.yaml): the hidden states (train split trains, our
# eval split is speculators' validation split), the draft vocabulary (our d2t/t2d, 32,000 tokens), the aux layers
# [2, 15, 27], 2 epochs, 4 unroll (TTT) steps, 16,384 tokens per batch, and the draft's architecture (one Llama layer
# without speculators' extra norms, so our evaluator and our checkpoint format take it unchanged:
# --no-norm-before-fc --no-norm-output --no-norm-before-residual). The optimiser, schedule and loss are speculators'
# own defaults (Muon lr 1e-3, linear schedule, KL to the target's distribution): that is the anchor's recipe. Its loss
# runs as speculators' "eager" implementation: the default "fused" Triton kernel failed on the H200 machine (torch 2.11)
# inside torch.compile ("ListVariable(length=21) is already tracked for mutation" in loss_backward_kernel's autotune
# configs); eager is speculators' own reference implementation of the same KL loss.
set -u
export PYTHONPATH=/tmp/site-anchor:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=${ANCHOR_WORKFLOW:-/root/w}     # the finished h200-quality workflow directory
T=$W/resources/targets/smollm2-135m
A=${ANCHOR_DIR:-/root/anchor}
# ANCHOR_TRAIN replaces the trainer command and ANCHOR_EXTRA adds flags (e.g. ANCHOR_EXTRA="--max-steps 20" for a smoke
# run); the CPU smoke test of this recipe used both (speculators' trainer itself needs an accelerator and Triton).
TRAIN=${ANCHOR_TRAIN:-python3 -m speculators.train}
LAYERS="2 15 27"
# The anchor trains on the share FRACTION of our train sequences (the subset train.data_fraction picks, so its twin is
# the data-scaling point at that share, tools/scaling): the machine's 64 GiB disk holds our ~41 GB of shards and
# speculators' copy of a quarter of them, not of all. EPOCHS: our recipe's (config/examples/h200-quality.yaml).
FRACTION=${ANCHOR_FRACTION:-0.25}
EPOCHS=${ANCHOR_EPOCHS:-2}
mkdir -p $OUT $A
stage=${1:-}
common() {  # the flags every speculators run takes; $1 = save path
    python3 -c "import json; d = json.load(open('$A/data/anchor.json')); print(d['train_data_ratio'], d['draft_vocab_size'])" \
        > $A/ratio.txt || exit 1
    read RATIO VOCAB < $A/ratio.txt
    echo --verifier-name-or-path $T --data-path $A/data --speculator-type eagle3 --save-path $1 --log-dir $1/logs \
        --train-data-ratio $RATIO --draft-vocab-size $VOCAB --target-layer-ids $LAYERS --epochs $EPOCHS --ttt-steps 4 \
        --total-seq-len 16384 --num-workers 8 --full-attention-indices 0 --log-freq 50 --loss-implementation eager
}
run_train() {  # $1 = save path, rest = extra flags; bounded so the call returns its log; rerun resumes
    save=$1; shift
    start=$(date +%s)
    timeout ${ANCHOR_TRAIN_TIMEOUT:-540} $TRAIN $(common $save) "$@" ${ANCHOR_EXTRA:-} > $save.log 2>&1
    rc=$?
    echo "$(( $(date +%s) - start ))" >> $save.seconds
    echo "speculators train rc=$rc (124 = stopped at the limit: rerun this stage to resume) in $(tail -1 $save.seconds) s"
    grep -a "train/loss=\|val/loss_epoch\|full_acc_0_epoch\|Error\|error" $save.log | tail -12
    ls $save
    cp $save.log $OUT/
}
case "$stage" in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-anchor \
        .whl-anchor/*.whl 2>&1 | tail -2
    touch /tmp/site-anchor/.ready   # h200.sh chain waits for it
    python3 -c "import torch, transformers, triton, speculators, datasets, hs_connectors, speculators.train.cli
from importlib.metadata import version  # speculators has no __version__
print('speculators', version('speculators'), 'torch', torch.__version__, 'transformers', transformers.__version__,
      'triton', triton.__version__, torch.cuda.get_device_name(0))"
    ;;
convert)
    ls $W/results/hidden_states/train/*.safetensors $W/results/hidden_states/eval/*.safetensors > /dev/null || {
        echo "no hidden-state shards under $W/results/hidden_states: run bash tests/gpu/h200.sh quality first" >&2; exit 1; }
    mkdir -p $A; all=$(du -sbL $W/results/hidden_states | cut -f1); free=$(df -B1 --output=avail $A | tail -1)
    need=$(python3 -c "print(int($all * min(1.0, $FRACTION + 0.05)))")   # the share plus the eval split
    echo "shards $(( all >> 30 )) GiB, copy of share $FRACTION ~$(( need >> 30 )) GiB, free $(( free >> 30 )) GiB"
    [ $free -gt $(( need + (need >> 3) )) ] || { echo "not enough disk for speculators' copy" >&2; exit 1; }
    rm -rf $A/data
    start=$(date +%s)
    python3 tests/gpu/anchor_convert.py to-speculators --target $T --out $A/data --vocab-from $W/results/draft \
        --train $W/results/hidden_states/train/*.safetensors --val $W/results/hidden_states/eval/*.safetensors \
        --data-fraction $FRACTION --seed 0 2>&1 | grep -v "Saving the dataset"
    echo "converted in $(( $(date +%s) - start )) s"
    cp $A/data/anchor.json $OUT/anchor-data.json
    ;;
train)
    run_train $A/ckpt --no-norm-before-fc --no-norm-output --no-norm-before-residual
    ;;
eval)
    last=$A/ckpt/$(ls $A/ckpt | grep -E "^[0-9]+$" | sort -n | tail -1)
    echo "checkpoint $last"
    rm -rf $A/draft
    python3 tests/gpu/anchor_convert.py to-eaglepipe --target $T --checkpoint $last --aux-layer-ids $LAYERS \
        --out $A/draft || exit 1
    start=$(date +%s)
    python3 - <<PY 2>&1 | grep -v "Loading weights"
import glob, json
from eaglepipe.evaluate import run
ours = json.load(open("$W/results/eval/acceptance.json"))  # the same max_k and eval shards as our draft's score
run(sorted(glob.glob("$W/results/hidden_states/eval/*.safetensors")), "$A/draft", "$OUT/anchor-acceptance.json",
    target_dir="$T", max_k=ours["max_k"], max_tokens=16384, threads=16, device="cuda")  # on CPU it took > 4 min
anchor = json.load(open("$OUT/anchor-acceptance.json"))
data = json.load(open("$A/data/anchor.json"))
seconds = sum(int(s) for s in open("$A/ckpt.seconds").read().split())
twin = None  # our recipe on the same share of the data: the scaling run's point (h200.sh scaling keeps a copy)
if glob.glob("/root/scaling.json"):
    twin = next((p for p in json.load(open("/root/scaling.json"))["points"]
                 if abs(p["fraction"] - data["data_fraction"]) < 1e-9), None)
summary = {"anchor": "speculators 0.9.0 (python -m speculators.train)", "checkpoint": "$last",
           "anchor_offline_tau3": anchor["tau"]["3"], "ours_offline_tau3": ours["tau"]["3"],
           "ours_same_data": twin, "ours_same_data_tau3": twin and twin["tau"]["3"],
           "anchor_tau": anchor["tau"], "ours_tau": ours["tau"], "positions": anchor["positions"], "ours_positions": ours["positions"],
           "train_tokens": data["tokens"]["train"], "anchor_train_seconds": seconds, "data": data}
json.dump(summary, open("$OUT/anchor.json", "w"), indent=2)
print(json.dumps({k: summary[k] for k in ("anchor_offline_tau3", "ours_same_data_tau3", "ours_offline_tau3",
                                          "anchor_train_seconds")}))
PY
    echo "evaluated in $(( $(date +%s) - start )) s"
    # Serve it on the CPU machine like ours (README: the anchor side by side). In 15 MB parts: the device tool left a
    # 37 MB file behind ("size"); cat anchor-draft.tgz.part-* | tar -xzf - on the CPU machine.
    tar -C $A -czf - draft | split -b 15M - $OUT/anchor-draft.tgz.part-
    ;;
native)
    # speculators' defaults for the architecture (norm before fc, post-norm output fed back, normed residual): vLLM
    # serves this form natively; our evaluator does not (anchor_convert.py to-eaglepipe refuses it, naming the norms).
    run_train $A/ckpt-native
    last=$A/ckpt-native/$(ls $A/ckpt-native | grep -E "^[0-9]+$" | sort -n | tail -1)
    mkdir -p $A/native && cp $last/config.json $A/native/ && python3 - <<PY
from safetensors.torch import load_file, save_file
state = load_file("$last/model.safetensors")  # drop the verifier's own tensors: vLLM takes the target's embedding
save_file({k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "verifier_"))},
          "$A/native/model.safetensors", metadata={"format": "pt"})
PY
    tar -C $A -czf $OUT/anchor-native-draft.tgz native
    ;;
*)
    echo "usage: bash tests/gpu/anchor_speculators.sh setup|convert|train|eval|native" >&2
    exit 2
    ;;
esac
