# The one-H200 runs behind README "Fast on one GPU" and "A draft worth serving", one stage per device call (a call
# runs at most 10 minutes; the machine keeps /root and /tmp between calls while it is warm, and it goes back after 30 s
# idle: chain the calls with no pause, or the next call finds a bare machine and setup-a/setup-b must run again).
# GGUF parts: split -b 37000000 SmolLM2-135M-Instruct.Q4_1.gguf gguf.part.; aa into .gguf/a, the rest into .gguf/b
# (.whl, ~27 MB, plus part aa stay within one call's 64 MiB).
#   bash tests/gpu/h200.sh setup-a   # carry .whl and .gguf/a: wheels the machine lacks, first half of the GGUF
#   bash tests/gpu/h200.sh setup-b   # carry .gguf/b: second half; the embedded target converted as the target rule does
#   bash tests/gpu/h200.sh bench     # generation and extraction (SmolLM2 and an 8B-shaped Llama) benchmarks
#   bash tests/gpu/h200.sh bench-8b  # the 8B-shaped extraction alone: setup-a (wheels) is all it needs
#   bash tests/gpu/h200.sh bench-train  # draft training benchmark (Kimi-K2- and SmolLM2-shaped drafts)
#   bash tests/gpu/h200.sh quality [TARGET...]   # the h200-quality workflow up to TARGET (default: the acceptance
#                                                # and the trace stats)
#   bash tests/gpu/h200.sh scaling   # tau against training tokens on the finished workflow
# Or, after setup-a and setup-b, all of it in one process session that outlives the calls (a machine goes back 30
# minutes after its start, whatever runs: the chain fits that, the single stages' calls barely did):
#   bash tests/gpu/h200.sh chain     # quality, bundle, the scaling point at the anchor's share (SCALING_FRACTIONS,
#                                    # default 0.25), then the anchor (tests/gpu/anchor_speculators.sh)
#   bash tests/gpu/h200.sh wait      # each following call: waits up to WAIT s, brings back the files done since the
#                                    # last call (at most 8 files / 60 MiB a call, the device tool's limit)
# The chain writes to /root/chain, not /root/out: the device tool's $OUT there IS /root/out, emptied before each call.
# A gap of more than 30 s between two calls still loses the machine and the chain with it (2026-12-04: one did).
# Figures land in $OUT (the device tool brings them back) and in docs/measured/ once committed.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
W=/root/w
T=$W/resources/targets/smollm2-135m
mkdir -p $OUT
stage=${1:-}
shift || true
case "$stage" in
setup-a)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -2
    [ -d .gguf/a ] && cp .gguf/a/* /root/ && ls -la /root/gguf.part.aa   # not needed by bench-8b
    python3 -c "import snakemake, gguf, torch; print('snakemake', snakemake.__version__, 'torch', torch.__version__,
        torch.cuda.get_device_name(0))"
    ;;
setup-b)
    mkdir -p /root/gguf && cat /root/gguf.part.aa .gguf/b/gguf.part.* > /root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16
    python3 - <<'PY'
import shutil, sys
from pathlib import Path
from eaglepipe.target import convert_gguf, EMBEDDED_GGUF
out = Path("/root/w/resources/targets/smollm2-135m")
out.parent.mkdir(parents=True, exist_ok=True)
convert_gguf(Path("/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"), out)
print(sorted(p.name for p in out.iterdir()))
PY
    ;;
bench)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    python3 -m eaglepipe.tools.bench_generation --target $T --device cuda --dtype bfloat16 --max-new-tokens 256 \
        --repeat 4 --baseline-prompts 256 --json $OUT/gpu-generation.json 2>&1 | grep -v "Loading weights"
    python3 -m eaglepipe.tools.bench_extraction --target $T --device cuda --tokens 4000000 --baseline-tokens 1000000 \
        --chunk-size 256 --out /root/bench-out --json $OUT/gpu-extraction-smollm2.json 2>&1 | grep -v "Loading weights"
    bash $0 bench-8b
    ;;
bench-8b)   # needs setup-a only (its wheels; no GGUF): the 8B shape has random weights. Two shard sizes: 1M tokens
            # (32 GB, the size of a production shard: config/kimi-k2.5.yaml's 16 shards of the seed's 828 GB are ~52 GB
            # each) and 250K tokens (8 GB): each shard job fills and drains the device pipeline once
    for shard in 1000000 250000; do
        python3 -m eaglepipe.tools.bench_extraction --preset llama-8b --device cuda --tokens 1000000 \
            --baseline-tokens 250000 --shard-tokens $shard --out /root/bench-out --max-batch-tokens 16384 \
            --json $OUT/gpu-extraction-llama8b-shard$shard.json 2>&1 | grep -v "Loading weights"
    done
    ;;
bench-train)
    python3 -m eaglepipe.tools.bench_train --preset kimi-k2 --device cuda --tokens 4096 --seq-len 2048 --ttt-steps 7 \
        --steps 3 --json $OUT/gpu-training-kimi.json 2>&1 | tail -25
    python3 -m eaglepipe.tools.bench_train --preset smollm2-135m --device cuda --draft-vocab 32000 --tokens 16384 \
        --seq-len 512 --ttt-steps 7 --steps 5 --no-baseline --json $OUT/gpu-training-smollm2.json 2>&1 | tail -25
    ;;
quality)
    # LIMIT seconds at most (a call runs 10 minutes): then every job's stacks go to its log (SIGUSR1) and Snakemake is
    # interrupted; the next call resumes (--rerun-incomplete, the jobs' resume units).
    LIMIT=${LIMIT:-520}
    export CUDA_VISIBLE_DEVICES=0   # one GPU: no slot claiming (a job left over from an earlier call cannot block)
    pkill -f "python3 -m snakemake -s" 2>/dev/null; sleep 1
    rm -rf $W/.snakemake/locks   # a call killed at its limit leaves the lock of a Snakemake no longer running
    cat > /root/gpu.yaml <<Y
target: {path: $T}
Y
    mkdir -p $W
    C="--configfile $PWD/config/config.yaml $PWD/config/examples/h200-quality.yaml /root/gpu.yaml"
    start=$(date +%s)
    python3 -m snakemake -s $PWD/Snakefile -d $W --cores 16 --resources gpu=1 --scheduler greedy --rerun-incomplete \
        ${@:-results/eval/acceptance.json results/traces/stats.json} $C > $OUT/quality-snakemake.log 2>&1 &
    smk=$!
    # The watcher's output goes nowhere: a sleep left holding the call's stdout would keep the call open to its end.
    # Snakemake waits for running jobs after SIGINT; 15 s later they are killed (a job resumes from its units), so the
    # call ends by LIMIT + 25 s.
    ( sleep $LIMIT; pkill -USR1 -f "snakemake/scripts/tmp"; sleep 5; kill -INT $smk; sleep 15
      pkill -KILL -f "snakemake/scripts/tmp"; sleep 3; kill -KILL $smk ) >/dev/null 2>&1 &
    watcher=$!
    wait $smk
    rc=$?
    pkill -P $watcher 2>/dev/null; kill $watcher 2>/dev/null
    echo "snakemake rc=$rc in $(( $(date +%s) - start )) s"
    grep -h "Error\|error:" -A12 $OUT/quality-snakemake.log | head -40
    grep -h "jobs\|Finished job\|steps (" $OUT/quality-snakemake.log | tail -4
    for f in $W/logs/*.log $W/logs/*/*/*.log; do [ -f $f ] && { echo "== $f"; tail -4 $f; }; done 2>/dev/null | cut -c1-300
    grep -h -A30 "Thread 0x\|Current thread" $W/logs/*.log $W/logs/*/*/*.log 2>/dev/null | head -60
    cat $W/benchmarks/*.tsv $W/benchmarks/*/*/*.tsv 2>/dev/null | awk 'NR==1 || !/^s/' | cut -f1 | paste -sd' '
    for f in results/prompts/synthesized.json results/traces/stats.json results/eval/acceptance.json; do
        [ -f $W/$f ] && { echo "== $f"; cat $W/$f; }
    done
    if [ -f $W/results/eval/acceptance.json ]; then  # the draft bundle (bench.draft) and the run's reports, 15 MB parts
        rm -rf /root/bundle && python3 -m eaglepipe.tools.bundle --directory $W --out /root/bundle
        tar -C /root -czf /root/quality.tgz bundle -C $W results/traces/stats.json results/prompts/synthesized.json \
            results/vocab/coverage.json results/hidden_states/manifest.json logs benchmarks
        split -b 15M /root/quality.tgz $OUT/quality.tgz.part-
        ls -la $OUT
    fi
    tail -c 2000000 $OUT/quality-snakemake.log > /root/q.log && mv /root/q.log $OUT/quality-snakemake.log
    ;;
scaling)
    C="$PWD/config/config.yaml $PWD/config/examples/h200-quality.yaml /root/gpu.yaml"
    python3 -m eaglepipe.tools.scaling --directory $W --configfile $C --json $OUT/scaling.json --plot $OUT/scaling.png \
        ${@} 2>&1 | grep -v "Loading weights" | grep "tau\|shards\|Error\|error" | tail -20
    cp $OUT/scaling.json /root/scaling.json   # the anchor's same-data twin (anchor_speculators.sh eval)
    ;;
chain)
    # From a copy of the repository: a later call replaces the working tree the chain would be reading.
    rm -rf /root/repo /root/chain /root/sent && mkdir -p /root/chain && cp -r $PWD /root/repo && touch /root/sent
    cd /root/repo && setsid nohup bash -c "OUT=/root/chain LIMIT=100000 bash tests/gpu/h200.sh quality
        OUT=/root/chain bash tests/gpu/h200.sh scaling --fractions \${SCALING_FRACTIONS:-0.25}   # the anchor's twin
        while [ ! -f /tmp/site-anchor/.ready ]; do sleep 5; done   # anchor_speculators.sh setup, a later call
        for s in convert train eval; do OUT=/root/chain ANCHOR_TRAIN_TIMEOUT=\${ANCHOR_TRAIN_TIMEOUT:-480} bash tests/gpu/anchor_speculators.sh \$s \
            || break; done
        touch /root/chain/chain.done" > /root/chain/chain.log 2>&1 < /dev/null &
    echo "chain started"
    ;;
wait)
    end=$(( $(date +%s) + ${WAIT:-540} ))
    while [ ! -f /root/chain/chain.done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
    tail -c 6000 /root/chain/chain.log
    n=0; bytes=0   # the device tool brings back 8 files, 64 MiB at most: oldest unsent first
    for f in $(ls -tr /root/chain); do
        grep -qx "$f" /root/sent && continue
        size=$(stat -c %s /root/chain/$f)
        [ $n -lt 7 ] && [ $(( bytes + size )) -lt 62914560 ] || continue
        case $f in chain.log|chain.done) continue;; esac
        cp /root/chain/$f $OUT/ && echo "$f" >> /root/sent; n=$(( n + 1 )); bytes=$(( bytes + size ))
    done
    cp /root/chain/chain.log $OUT/ 2>/dev/null; ls -la $OUT
    ;;
*)
    echo "usage: bash tests/gpu/h200.sh setup-a|setup-b|bench|bench-8b|bench-train|quality|scaling|chain|wait" >&2
    exit 2
    ;;
esac
