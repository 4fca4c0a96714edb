# A Kimi-K2-rope (yarn, factor 32) tiny DeepSeek-V3 target on CUDA: the workflow to acceptance, then training forced
# again (determinism on CUDA) and forced once more, SIGKILLed after its first checkpoint and resumed (byte-identical?).
# Run from the repository root on a GPU machine: bash tests/gpu/yarn_cuda.sh (wheels the machine lacks in .whl*/).
set -u
TOKENIZER_FROM=${TOKENIZER_FROM:-resources/targets/smollm2-135m}
for w in .whl*; do [ -d "$w" ] && python -m pip install -q --no-deps $w/*.whl 2>&1 | tail -2; done
export PYTHONPATH=$PWD
python -c "
import sys; sys.path.insert(0, 'tests'); from pathlib import Path; import tiny_targets
tiny_targets.kimi_rope(Path('/root/kimi'), Path('$TOKENIZER_FROM'))" || exit 1
grep -A9 rope_scaling /root/kimi/config.json | tr -d '\n '; echo
cat > /root/cfg.yaml <<'Y'
target: {name: tiny-kimi-rope, path: /root/kimi}
engine: {name: transformers, device: cuda, dtype: bfloat16, batch_size: 32, gpus: 1}
prompts: {max_prompts: 160}
generation: {max_new_tokens: 64, num_shards: 2, chunk_size: 16}
vocab: {draft_vocab_size: 4096}
train: {device: cuda, gpus: 1, epochs: 6, ttt_steps: 3, checkpoint_every: 10, log_every: 10}
Y
S="python -m snakemake --cores 8 -d /root/w"
T=results/eval/acceptance.json
C="--configfile config/config.yaml /root/cfg.yaml"
( time $S $T $C > /root/a.log 2>&1 ) 2>&1 | grep real
[ -f /root/w/$T ] || { grep -B2 -A30 "Error in rule" /root/a.log | head -60; tail -30 /root/w/logs/train.log; exit 1; }
grep -h "training:\|step .*/\|final weights" /root/w/logs/train.log | head -4
python -c "import json; a=json.load(open('/root/w/$T')); print('tau', a['tau'])"
sha() { sha256sum /root/w/results/draft/model.safetensors | cut -c1-16; }
ref=$(sha); echo "reference draft $ref"
$S --forcerun train results/draft/model.safetensors $C > /root/b.log 2>&1; echo "forced again: $(sha) (rc $?)"
setsid $S --forcerun train results/draft/model.safetensors $C > /root/c1.log 2>&1 &
pid=$!
for i in $(seq 1200); do [ -f /root/w/results/draft/.progress/checkpoint.pt ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
kill -9 -- -$pid; sleep 2; echo "killed; progress: $(ls /root/w/results/draft/.progress/ 2>&1 | tr '\n' ' ')"
$S --unlock $C > /dev/null 2>&1
$S --rerun-incomplete results/draft/model.safetensors $C > /root/c2.log 2>&1; echo "rerun rc=$?: $(sha)"
grep -h "resuming\|checkpoint at" /root/w/logs/train.log | head -3
[ -n "${OUT:-}" ] && cp /root/w/logs/train.log /root/a.log /root/c2.log $OUT/; true
