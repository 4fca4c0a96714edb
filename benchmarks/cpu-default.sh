#!/usr/bin/env bash
# The embedded default on this machine's CPUs (docs/results.md, "The embedded default on a 2-core CPU"): a fresh
# clone of HEAD in $OUT/cpu-default, then the README's first command there, timed. Writes $OUT/cpu-default.json:
# workflow wall seconds, each rule's seconds (Snakemake's benchmark files), offline tau (greedy, at T > 0, per
# request, by position), MT-Bench tau and the served bench's figures. VENV=path reuses an installed .venv
# (setup.sh's install is then not part of the run).
set -euo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
C=$OUT/cpu-default
rm -rf "$C"
git clone -q . "$C"
cd "$C"
# with VENV, the clone's package comes first on the path (an editable install there points elsewhere)
if [ -n "${VENV:-}" ]; then ln -s "$VENV" .venv; export PYTHONPATH=$C; else bash setup.sh; fi
start=$SECONDS
.venv/bin/snakemake --cores all
seconds=$((SECONDS - start))
.venv/bin/python - "$seconds" "$OUT/cpu-default.json" <<'PY'
import csv, json, os, sys
from pathlib import Path

from eaglepipe.tools.limits import commit

seconds, out = int(sys.argv[1]), Path(sys.argv[2])
read = lambda p: json.loads(Path(p).read_text()) if Path(p).is_file() else None
acc = read("results/eval/acceptance.json")
mtbench = read("results/benchmarks/mtbench/acceptance.json")
rules = {}
for tsv in sorted(Path("benchmarks").rglob("*.tsv")):
    with open(tsv) as f:
        row = next(csv.DictReader(f, delimiter="\t"))
    rules[str(tsv.relative_to("benchmarks").with_suffix(""))] = round(float(row["s"]), 1)
result = {
    "device": f"CPU, {os.cpu_count()} cores", "commit": commit(), "command": "bash benchmarks/cpu-default.sh",
    "workflow_seconds": seconds, "rule_seconds": rules,
    "offline_tau": acc["tau"], "offline_tau_request_mean": acc.get("tau_request_mean"),
    "offline_tau_by_temperature": {t: r["tau"] for t, r in acc.get("temperatures", {}).items()},
    "offline_by_position": acc.get("by_position"),
    "mtbench_tau": mtbench and mtbench["tau"], "mtbench_by_category": mtbench and {
        c: r and r["tau"] for c, r in mtbench["by_category"].items()},
    "served": read("results/bench/served.json"), "serving_config": read("results/serve/vllm.json"),
}
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if k not in ("served", "offline_by_position")}, indent=2))
PY
