#!/usr/bin/env bash
# fp8 hidden-state shards against bf16 on the quality recipe (docs/results.md, "fp8 hidden-state shards"): run after
# quality.sh, in its workflow directory. The shards are extracted again in float8_e4m3fn (per-token scales), the draft
# trained and scored on them with the same data and seed, and the bf16 and fp8 extraction rates measured in one run on
# the same sequences. Writes $OUT/fp8.json (tau3_bf16, tau3_fp8, bytes_per_token_bf16/fp8, extract_tok_s_bf16/fp8);
# afterwards the workflow directory holds the fp8 run (the bf16 draft stays in $OUT/draft-bundle).
set -euo pipefail
OUT=${OUT:-benchmarks/out}
W=${WORKDIR:-$OUT/quality}
T=${TARGET:-$W/resources/targets/smollm2-135m}
C="config/config.yaml config/examples/h200-quality.yaml"
[ -f "$OUT/quality-acceptance.json" ] || { echo "run benchmarks/quality.sh first (no $OUT/quality-acceptance.json)"; exit 1; }
echo "${EAGLEPIPE_COMMIT:-$(git rev-parse HEAD)}" > "$OUT/fp8.commit"
python -m eaglepipe.tools.shard_bytes --directory "$W" --json "$OUT/fp8-shards-bf16.json"
printf 'hidden_states: {dtype: float8_e4m3fn}\n' > "$OUT/fp8.yaml"
start=$SECONDS
snakemake -d "$W" --cores all --resources gpu=1 --scheduler greedy --rerun-incomplete results/eval/acceptance.json \
    --configfile $C "$OUT/fp8.yaml"
echo "fp8 shards to offline acceptance: $((SECONDS - start)) s"
python -m eaglepipe.tools.shard_bytes --directory "$W" --json "$OUT/fp8-shards-fp8.json"
cp "$W/results/eval/acceptance.json" "$OUT/fp8-acceptance.json"
python -m eaglepipe.tools.bench_extraction --target $T --device cuda --tokens 2000000 --skip-baseline \
    --chunk-size 256 --disk-probe-gb 1 --fp8 --out "$OUT/bench-out" --json "$OUT/fp8-extraction.json"
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
read = lambda name: json.loads((out / name).read_text())
bf16, fp8, extraction = read("quality-acceptance.json"), read("fp8-acceptance.json"), read("fp8-extraction.json")
result = {
    "device": extraction["device"], "commit": (out / "fp8.commit").read_text().strip(), "command": "bash benchmarks/fp8.sh",
    "bytes_per_token_bf16": read("fp8-shards-bf16.json")["bytes_per_token"],
    "bytes_per_token_fp8": read("fp8-shards-fp8.json")["bytes_per_token"],
    "tau3_bf16": bf16["tau"]["3"], "tau3_fp8": fp8["tau"]["3"],
    "tau_bf16": bf16["tau"], "tau_fp8": fp8["tau"],
    **{k: extraction[k] for k in ("extract_tok_s_bf16", "extract_tok_s_fp8", "tokens")},
}
result["tau3_fp8_over_bf16"] = result["tau3_fp8"] / result["tau3_bf16"]
result["bytes_fp8_over_bf16"] = result["bytes_per_token_fp8"] / result["bytes_per_token_bf16"]
(out / "fp8.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(result, indent=2))
PY
