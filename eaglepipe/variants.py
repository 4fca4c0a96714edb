"""Draft variants (train.variants): the comparison of their figures and the choice of the draft.

variants.json: {"k": the draft length of the figures (3, or evaluate.max_k when smaller), "criterion", "winner": the
variant whose draft is results/draft/, "variants": [one object per variant in the order of their names: name, overrides
(the variant's train keys), tau {k: greedy offline tau on the eval split, pooled}, tau_at {T: tau at k at
temperature T}, outside_loops_tau (tau at k outside trailing loops), benchmarks {set: tau at k, greedy, pooled},
train_tokens, train_steps, train_seconds (the training job's wall time, from its Snakemake benchmark file)]}.

A sweep's second pass (combination): the overrides of the variants that beat the baseline (the variant with no
overrides), merged into one variant, best first, a key taken from the best variant that sets it.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

from .formats import atomic_path, write_json

log = logging.getLogger(__name__)

CRITERION = "offline tau at k on the eval split, greedy, pooled over verify steps (never a benchmark set)"


def _load(path) -> dict:
    return json.loads(Path(path).read_text())


def draft_length(acceptance: dict) -> int:
    """The k of the comparison: 3, the field's usual draft length, or max_k when smaller."""
    return min(3, int(acceptance["max_k"]))


def best(names: list[str], acceptance_paths: list) -> str:
    """The variant with the highest offline tau at k = draft_length on the eval split; a tie goes to the first of
    `names`."""
    taus = {}
    for name, path in zip(names, acceptance_paths, strict=True):
        acc = _load(path)
        taus[name] = acc["tau"][str(draft_length(acc))]
    return max(names, key=lambda n: (taus[n], -names.index(n)))


def select(names: list[str], acceptance_paths: list, draft_files: dict[str, list], out_files: dict[str, str]) -> str:
    """Copy the best variant's draft files (draft_files[field]: one path per variant, in names' order) to
    out_files[field]; returns its name."""
    winner = best(names, acceptance_paths)
    i = names.index(winner)
    for field, target in out_files.items():
        with atomic_path(target) as tmp:
            shutil.copyfile(draft_files[field][i], tmp)
    log.info("the draft is variant %s (best offline tau on the eval split of %s)", winner, ", ".join(names))
    return winner


def train_seconds(benchmark_path) -> float:
    """Wall-clock seconds of a job from its Snakemake benchmark file (TSV with an `s` column)."""
    with open(benchmark_path, newline="") as f:
        return float(next(csv.DictReader(f, delimiter="\t"))["s"])


def compare(names: list[str], overrides: dict, *, acceptance, train_log, seconds, benchmarks=(),
            output_path) -> dict:
    """variants.json from each variant's acceptance.json, train_log.jsonl, training benchmark file and benchmark
    acceptance files (results/drafts/{variant}/benchmarks/{set}/acceptance.json)."""
    rows = []
    for i, name in enumerate(names):
        acc = _load(acceptance[i])
        k = str(draft_length(acc))
        records = [json.loads(line) for line in Path(train_log[i]).read_text().splitlines() if line.strip()]
        sets = {Path(p).parent.name: _load(p) for p in benchmarks if Path(p).parts[-4] == name}
        rows.append({
            "name": name, "overrides": overrides.get(name, {}),
            "tau": acc["tau"], "tau_at": {t: r["tau"][k] for t, r in acc.get("temperatures", {}).items()},
            "outside_loops_tau": acc["outside_loops"]["tau"][k],
            "benchmarks": {s: b["tau"][k] for s, b in sorted(sets.items())},
            "train_tokens": records[-1]["tokens"] if records else 0,
            "train_steps": records[-1]["step"] if records else 0,
            "train_seconds": round(train_seconds(seconds[i]), 1),
        })
    result = {"k": int(k), "criterion": CRITERION.replace("at k", f"at k = {k}"),
              "winner": best(names, acceptance), "variants": rows}
    write_json(output_path, result)
    return result


def combination(table: dict) -> dict | None:
    """The overrides of one variant combining the winners of a one-factor sweep (variants.json): the variants whose
    tau at the table's k beats the baseline's (the variant with no overrides), best first (a tie to the first name),
    each adding the keys no better variant has set. None when fewer than two variants win, or when the merge equals a
    measured variant's overrides (two winners setting the same key): nothing new to train."""
    k = str(table["k"])
    rows = table["variants"]
    baselines = [r for r in rows if not r["overrides"]]
    if len(baselines) != 1:
        raise ValueError(f"a combination needs exactly one variant without overrides as its baseline; the table has "
                         f"{len(baselines)} ({', '.join(r['name'] for r in baselines) or 'none'})")
    base = baselines[0]["tau"][k]
    winners = sorted((r for r in rows if r["overrides"] and r["tau"][k] > base),
                     key=lambda r: (-r["tau"][k], rows.index(r)))
    if len(winners) < 2:
        return None
    merged: dict = {}
    for r in winners:
        merged.update({key: value for key, value in r["overrides"].items() if key not in merged})
    if any(r["overrides"] == merged for r in rows):
        return None
    log.info("combination of %s (tau at k = %s over the baseline's %.3f): %s",
             ", ".join(f"{r['name']} {r['tau'][k]:.3f}" for r in winners), k, base, merged)
    return merged
