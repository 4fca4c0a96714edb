# SLURM with a real GPU: the tiny workflow submitted through profiles/slurm to a one-node test cluster whose gres is
# /dev/nvidia0, transformers engine and training on CUDA. Run as root from the repository root on a GPU machine:
#   bash tests/gpu/slurm_gpu.sh
# Where SLURM is not installed and cannot be (no package index), Debian 12's slurmd, slurmctld, slurm-client,
# slurm-wlm-basic-plugins, munge and libmunge2 (+ their libraries) can be carried as .deb files in .slurmdebs/
# (`apt-get download ...` on a Debian 12 machine); Python wheels the machine lacks in .whl*/.
set -u
TOKENIZER_FROM=${TOKENIZER_FROM:-resources/targets/smollm2-135m}
cat /etc/os-release | head -2; ls -l /dev/nvidia* | head
for w in .whl*; do [ -d "$w" ] && python -m pip install -q --no-deps $w/*.whl 2>&1 | tail -2; done
if [ -d .slurmdebs ] && ! command -v slurmd >/dev/null; then
for d in .slurmdebs/slurm*.deb .slurmdebs/munge*.deb .slurmdebs/libmunge2*.deb; do dpkg -x $d /; done
for b in slurmd slurmctld slurmstepd; do ln -sf /usr/sbin/$b-wlm /usr/sbin/$b; done  # Debian links these by update-alternatives
mkdir -p /opt/slurmlibs-x; for d in .slurmdebs/lib*.deb; do case $d in *libmunge2*) ;; *) dpkg -x $d /opt/slurmlibs-x;; esac; done
ldconfig -p | awk 'NR>1{print $1}' > /tmp/have; mkdir -p /opt/slurmlibs; for f in $(find /opt/slurmlibs-x -name "*.so.*"); do b=$(basename $f); grep -qx "$b" /tmp/have || cp -a $f /opt/slurmlibs/; done
echo /opt/slurmlibs > /etc/ld.so.conf.d/zz-slurm.conf; ldconfig  # only libraries the machine lacks: nothing shadowed
fi
for b in /usr/sbin/slurmd /usr/sbin/slurmctld /usr/sbin/slurmstepd /usr/bin/sbatch /usr/sbin/munged; do ldd $b | grep "not found" && echo "MISSING for $b"; done
ldd /usr/lib/x86_64-linux-gnu/slurm-wlm/gpu_nvml.so 2>/dev/null | grep "not found"
hostname; /usr/sbin/slurmd -C | head -1
TOKENIZER_FROM=$TOKENIZER_FROM python - <<'PY'
import os, shutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
c = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained("/root/tiny")
for n in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
    shutil.copy(os.environ["TOKENIZER_FROM"] + "/" + n, "/root/tiny/" + n)
PY
cat > /root/cfg.yaml <<'Y'
target: {name: tiny, path: /root/tiny}
engine: {name: transformers, device: cuda, dtype: bfloat16, batch_size: 32, gpus: 1}
prompts: {max_prompts: 120}
generation: {max_new_tokens: 48, num_shards: 2, chunk_size: 16}
vocab: {draft_vocab_size: 4096}
train: {device: cuda, gpus: 1, epochs: 2, ttt_steps: 3}
Y
export PYTHONPATH=$PWD EAGLEPIPE_TEST_GPU_DEVICES=/dev/nvidia0
mkdir -p /root/s
( time python tests/slurm_cluster.py --folder /root/cluster -- python -m snakemake -s Snakefile -d /root/s --workflow-profile profiles/slurm --slurm-status-command squeue --slurm-no-account --slurm-init-seconds-before-status-checks 2 results/eval/acceptance.json --configfile config/config.yaml /root/cfg.yaml > /root/s.log 2>&1 ) 2>&1 | tail -3
grep -E "SLURM job records|job +[0-9]+ |command exited" /root/s.log
grep -h "SLURM job\|claimed\|device\|cuda" /root/s/logs/train.log /root/s/logs/traces/*.log /root/s/logs/hidden_states/*.log 2>/dev/null | head -12
grep -o "TresPerJob=\S*\|NumTasks=\S*" /root/cluster/scontrol-jobs.txt | sort | uniq -c
cat /root/s/results/eval/acceptance.json 2>/dev/null | head -c 300; echo
[ -f /root/s/results/eval/acceptance.json ] || { tail -40 /root/s.log; tail -20 /root/cluster/slurmd.log; for f in /root/s/.snakemake/slurm_logs/*/*.log /root/s/.snakemake/slurm_logs/*/*/*.log; do echo "== $f"; tail -8 $f; done 2>/dev/null | tail -60; }
[ -n "${OUT:-}" ] && cp /root/s.log /root/cluster/jobcomp.txt /root/cluster/scontrol-jobs.txt /root/s/logs/train.log $OUT/; true
