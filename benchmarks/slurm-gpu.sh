#!/usr/bin/env bash
# SLURM with a GPU as the cluster's gres (docs/results.md, "SLURM with a GPU as the cluster's gres"): a tiny Llama's
# workflow through profiles/slurm on a one-node test cluster (tests/slurm_cluster.py) whose gres is the real
# /dev/nvidia0, transformers engine and training on CUDA. Run as root where slurm-wlm and munge are installed (as
# setup.sh installs them). Writes $OUT/slurm-gpu.json (wall seconds, the SLURM job records), the cluster's view of
# the jobs ($OUT/slurm-gpu-scontrol.txt) and $OUT/slurm-gpu-train.log.
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)   # the config names the target by its absolute path
T=resources/targets/smollm2-135m
S=$OUT/slurm-gpu
git rev-parse HEAD > "$OUT/slurm-gpu.commit"
[ -f $T/config.json ] || snakemake --cores 1 $T
rm -rf "$S" && mkdir -p "$S"
python - "$S/target" "$T" <<'PY'
import shutil, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
c = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained(sys.argv[1])
for n in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
    shutil.copy(f"{sys.argv[2]}/{n}", f"{sys.argv[1]}/{n}")
PY
cat > "$S/config.yaml" <<Y
target: {name: tiny, path: $S/target}
engine: {name: transformers, device: cuda, dtype: bfloat16, batch_size: 32, gpus: 1}
prompts: {max_prompts: 120}
generation: {max_new_tokens: 48, num_shards: 2, chunk_size: 16}
vocab: {draft_vocab_size: 4096}
train: {device: cuda, gpus: 1, epochs: 2, ttt_steps: 3}
Y
start=$SECONDS
EAGLEPIPE_TEST_GPU_DEVICES=/dev/nvidia0 python tests/slurm_cluster.py --folder "$S/cluster" -- \
    python -m snakemake -s Snakefile -d "$S/work" --workflow-profile profiles/slurm --slurm-status-command squeue \
    --slurm-no-account --slurm-init-seconds-before-status-checks 2 results/eval/acceptance.json \
    --configfile config/config.yaml "$S/config.yaml"
seconds=$((SECONDS - start))
cp "$S/cluster/scontrol-jobs.txt" "$OUT/slurm-gpu-scontrol.txt"
cp "$S/work/logs/train.log" "$OUT/slurm-gpu-train.log"
python -c "import json, sys; sys.path.insert(0, 'tests'); from pathlib import Path; import slurm_cluster
print(json.dumps({'seconds': $seconds, 'jobs': slurm_cluster.job_records(Path('$S/cluster'))}, indent=2))" \
    > "$OUT/slurm-gpu.json"
