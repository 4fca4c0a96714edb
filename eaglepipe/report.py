"""Report stage: one Markdown page with every stage's figures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .formats import atomic_path
from .schedule import DYNAMIC_FLOOR


def _load(path):
    return json.loads(Path(path).read_text())


def summary(*, target: str, trace_stats, coverage, manifest, train_log, acceptance, output_path, served=None,
            benchmarks=(), variants=()) -> None:
    stats, cov, man, acc = _load(trace_stats), _load(coverage), _load(manifest), _load(acceptance)
    log = [json.loads(line) for line in Path(train_log).read_text().splitlines() if line.strip()]
    lines = [f"# eaglepipe summary: {target}", "", "## Traces", "",
             "| split | samples | errors | truncated | ends in a loop | prompt tokens | output tokens | "
             "response tokens p10 / p50 / p90 / max |", "|---|---|---|---|---|---|---|---|"]
    for split, s in stats.items():
        n = s["response_tokens"]
        lines.append(f"| {split} | {s['samples']} | {s['errors']} | {100 * s['truncated_share']:.1f} % | "
                     f"{100 * s['looping_share']:.1f} % ({100 * s['looping_token_share']:.1f} % of tokens) | "
                     f"{s['prompt_tokens']} | {s['output_tokens']} | "
                     f"{n['p10']:.0f} / {n['p50']:.0f} / {n['p90']:.0f} / {n['max']} |")
    lines += ["", "## Vocabulary", "",
              f"Draft vocabulary {cov['draft_vocab_size']} of {cov['target_vocab_size']} covers "
              f"**{100 * cov['coverage']:.2f} %** of {cov['counted_tokens']} generated tokens "
              f"({cov['distinct_tokens']} distinct).", "", "| size | coverage |", "|---|---|"]
    lines += [f"| {c['size']} | {100 * c['coverage']:.2f} % |" for c in cov["curve"]]
    total_bytes = sum(Path(s["path"]).stat().st_size for s in man["shards"] if Path(s["path"]).exists())
    lines += ["", "## Hidden states", "",
              f"Layers {man['layer_ids']} ({man['layer_convention']}), {man['dtype']}, hidden {man['hidden_size']}, "
              f"target fingerprint `{man['target_fingerprint']}`, engine {man['engine']}.",
              f"Tokens: {', '.join(f'{k} {v}' for k, v in man['tokens'].items())}; {len(man['shards'])} shards, "
              f"{total_bytes / 1e6:.1f} MB.", "", "## Training", ""]
    if log:
        last = log[-1]
        lines += [f"{last['step']} steps, {last['tokens']} tokens. Last record, per unroll step:", "",
                  "| step j | " + " | ".join(str(j) for j in range(len(last["loss"]))) + " |",
                  "|---|" + "---|" * len(last["loss"]),
                  "| loss | " + " | ".join(f"{v:.3f}" for v in last["loss"]) + " |",
                  "| acc | " + " | ".join(f"{v:.3f}" for v in last["acc"]) + " |"]
    if variants:
        lines += variants_section(_load(variants[0]))
    lines += acceptance_section(acc)
    if benchmarks:
        lines += benchmarks_section([_load(p) for p in benchmarks])
    if served is not None:
        lines += served_section(_load(served), man["tokens"].get("train"), acc)
    with atomic_path(output_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def acceptance_section(acc: dict) -> list[str]:
    """Offline tau: greedy per k (pooled and per-request), at each evaluate temperature, and by context position.
    Keys added later (tau_request_mean, temperatures, by_position) are absent from older files (bundles)."""
    outside = acc.get("outside_loops")
    per_request = acc.get("tau_request_mean")
    extra = ((" tau outside trailing loops |", "---|") if outside else ("", ""))
    mean = ((" tau, mean over requests |", "---|") if per_request else ("", ""))
    lines = ["", "## Offline acceptance (eval split, greedy)", "",
             f"{acc['positions']} start positions" + (f" in {acc['requests']} requests" if per_request else "") + ".",
             "", "| k | tau, pooled over verify steps |" + mean[0] + " P(first k accepted) |" + extra[0],
             "|---|---|" + mean[1] + "---|" + extra[1]]
    lines += [f"| {k} | {acc['tau'][str(k)]:.3f} |" + (f" {per_request[str(k)]:.3f} |" if per_request else "")
              + f" {acc['per_position'][k - 1]:.3f} |"
              + (f" {outside['tau'][str(k)]:.3f} |" if outside else "") for k in range(1, acc["max_k"] + 1)]
    if per_request:
        lines += ["", "Pooled over verify steps: every start position of every request counts once (vLLM's and "
                  "SGLang's served figure, accepted tokens over verify steps). Mean over requests: each request's own "
                  "tau, averaged with equal weight (SpecForge's benchmark figure)."]
    if outside:
        lines += ["", f"{100 * outside['starts_in_loops']:.1f} % of the start positions draft into the loop their "
                  "response ends in (repeats a looping target makes trivial to draft); the last column leaves them "
                  "out."]
    temperatures = acc.get("temperatures") or {}
    if temperatures:
        runs = {"0": acc, **temperatures}
        lines += ["", "### At temperature T", "",
                  "Expected acceptance under vLLM's speculative sampling: the draft proposes its argmax, the target "
                  "accepts a proposal with its probability of it at T (top-p 1), read from the stored states of the "
                  "eval traces.", "",
                  "| k | " + " | ".join(f"T = {t} pooled | T = {t} mean over requests" for t in runs) + " |",
                  "|---|" + "---|---|" * len(runs)]
        lines += ["| " + " | ".join([str(k)] + [f"{r['tau'][str(k)]:.3f} | {r['tau_request_mean'][str(k)]:.3f}"
                                                for r in runs.values()]) + " |" for k in range(1, acc["max_k"] + 1)]
    if acc.get("by_position"):
        k = position_k(acc)
        runs = {"0": acc, **temperatures}
        lines += ["", f"### By context position (tau at k = {k}, pooled)", "",
                  "| position of the first drafted token | start positions | "
                  + " | ".join(f"T = {t}" for t in runs) + " |", "|---|---|" + "---|" * len(runs)]
        for i, b in enumerate(acc["by_position"]):
            taus = [f"{r['by_position'][i]['tau'][str(k)]:.3f}" if b["positions"] else "-" for r in runs.values()]
            lines.append(f"| {bucket_name(b)} | {b['positions']} | " + " | ".join(taus) + " |")
    return lines


def benchmarks_section(results: list[dict]) -> list[str]:
    """Offline tau per benchmark (benchmarks.score's acceptance.json) at k = position_k, pooled and per request, at
    T = 0 and each evaluate temperature; then per category, pooled at T = 0."""
    k = position_k(results[0])
    temps = list(results[0]["temperatures"])
    lines = ["", f"## Benchmarks (offline, tau at k = {k})", "",
             "The target answers every turn after its own earlier answers; the draft is scored on those traces as on "
             "the eval split. Pooled over verify steps and mean over requests as above.", "",
             "| benchmark | questions | start positions | T = 0 pooled | T = 0 mean over requests | "
             + " | ".join(f"T = {t} pooled | T = {t} mean over requests" for t in temps) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(temps)]
    for r in results:
        runs = [r] + [r["temperatures"][t] for t in temps]
        lines.append(f"| {r['benchmark']} | {r['questions']} | {r['positions']} | "
                     + " | ".join(f"{x['tau'][str(k)]:.3f} | {x['tau_request_mean'][str(k)]:.3f}" for x in runs) + " |")
    for r in results:
        lines += ["", f"{r['benchmark']} by category (T = 0, pooled):", "",
                  "| category | questions' start positions | tau |", "|---|---|---|"]
        lines += [f"| {c} | {f['positions'] if f else 0} | {f['tau'][str(k)]:.3f} |" if f else f"| {c} | 0 | - |"
                  for c, f in r["by_category"].items()]
    return lines


def position_k(acc: dict) -> int:
    """The draft length of the by-position figures: 3, the field's usual k, or max_k when smaller."""
    return min(3, int(acc["max_k"]))


def bucket_name(bucket: dict) -> str:
    def short(n):
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    return f"{short(bucket['from'])}+" if bucket["to"] is None else f"{short(bucket['from'])}-{short(bucket['to'])}"


def served_section(bench: dict, train_tokens: int | None = None, acceptance: dict | None = None) -> list[str]:
    """Served against offline tau over the same text, the speedup table by temperature, batch size and k, the serving
    config chosen from it and its confirming run, the diagnosis when there is one."""
    lines = ["", "## Served through vLLM (eval prompts)", "",
             f"{bench['prompts']} prompts, {bench['max_new_tokens']} new tokens. Served tau: greedy, every served "
             "prompt (vLLM's counters, pooled over verify steps; and each request's own, from vLLM's per-request "
             "metrics, "
             f"averaged). Offline tau over the same text: {bench['offline_text']}, over the verify steps greedy "
             "serving takes on it (each jumps past the tokens it accepted) and, as the evaluate stage counts, over "
             "every start position; last, the evaluate stage's over the traces' whole responses of the same "
             "conversations, a different text.", "",
             "| k | served tau, pooled | served tau, mean over requests | offline tau, same text, serving's steps | "
             "agrees | offline tau, same text, every start | offline tau, traces' whole responses |",
             "|---|---|---|---|---|---|---|"]
    for k, r in bench["k"].items():
        lines.append(f"| {k} | {r['served_tau']:.3f} | {_num(r['served_tau_request_mean'])} | "
                     f"{_num(r['offline_tau'])} | {'yes' if r['agrees'] else 'NO'} | "
                     f"{_num(r.get('offline_tau_positions'))} | {_num(r['offline_tau_traces'])} |")
    ks = list(bench["k"])
    for t, table in bench["speedup"].items():
        lines += ["", f"### Speedup over the target alone, T = {t}" + (" (greedy)" if float(t) == 0 else ""), "",
                  "Output tokens/s with the draft over the target alone, timed in alternating pairs on the same "
                  "prompts; the median of the pairs' ratios and their spread (* noisy: still wider than "
                  "`bench.tolerance` after `bench.max_repeats` pairs).", "",
                  "| batch size | " + " | ".join(f"k = {k}" for k in ks) + " | target alone, tok/s |",
                  "|---|" + "---|" * (len(ks) + 1)]
        for b, cells in table.items():
            base = statistics.median(c["baseline_tok_s"] for c in cells.values())
            lines.append(f"| {b} | " + " | ".join(_cell(cells[k]) for k in ks) + f" | {base:.1f} |")
        largest = table[max(table, key=int)]
        expected = (acceptance or {}).get("temperatures", {}).get(t) if float(t) else acceptance
        lines += ["", f"Served tau in the timed runs at batch {max(table, key=int)}: "
                  + ", ".join(f"k = {k} {largest[k]['served_tau']:.3f}" for k in ks)
                  + ("" if not expected else "; offline (the evaluate stage's, eval traces): "
                     + ", ".join(f"k = {k} {expected['tau'][k]:.3f}" for k in ks if k in expected["tau"])) + "."]
    serving = bench.get("serving")
    if serving:
        lines += ["", "### Serving config (`results/serve/vllm.json`)", "",
                  "Best k per batch size (greedy table; 0: do not speculate): "
                  + ", ".join(f"{b}: {k}" for b, k in serving["best_k"].items())
                  + f". {serving['note'][0].upper()}{serving['note'][1:]}.",
                  "", f"    {serving['command']}"]
        if bench.get("dynamic"):
            lines += ["", "That config served (greedy), against the best static k at each batch size: "
                      + ", ".join(f"batch {b}: {c['speedup']:.2f}x ({bench['dynamic_vs_best_static'][b]:.2f} of the "
                                  "best static)" for b, c in bench["dynamic"].items())
                      + (f". It keeps at least {DYNAMIC_FLOOR} of the best static k everywhere."
                         if bench["confirms"] else
                         f". **It falls below {DYNAMIC_FLOOR} of the best static k somewhere**: the table's "
                         "differences are within the noise there; serve more prompts (`bench.run_prompts`) or rerun "
                         "on a quiet machine.")]
    if train_tokens is not None:
        lines += ["", f"This draft trained on {train_tokens:,} tokens" + (
            ": drafts serve faster from several million (the data-scaling table of docs/results.md). The GPU recipe "
            "(config/examples/h200-quality.yaml) trains one; config/examples/serve-draft.yaml serves it here."
            if train_tokens < 1_000_000 else ".")]
    diagnosis = bench.get("diagnosis")
    if diagnosis:
        lines += ["", f"**Diagnosis** (k={diagnosis['k']}, {diagnosis['prompts']} prompts): {diagnosis['finding']}", "",
                  "| variant | served tau |", "|---|---|"]
        lines += [f"| {v['variant']}" + (f" {v['layer_ids']}" if v["kind"] != "template" else "") +
                  f" | {v['served_tau']:.3f} |" for v in diagnosis["variants"]]
        lines += [f"\nVariant {line}." for line in diagnosis.get("skipped", [])]
    return lines


def variants_section(table: dict) -> list[str]:
    """The draft variants of train.variants (eaglepipe.variants' variants.json), one row each, and which is the
    draft."""
    k, rows = table["k"], table["variants"]
    ks = sorted(rows[0]["tau"], key=int)
    temps, sets = list(rows[0]["tau_at"]), list(rows[0]["benchmarks"])
    lines = ["", "## Draft variants", "",
             f"Each variant trained on the same hidden states; the draft below is **{table['winner']}**, the best by "
             f"{table['criterion']}. Offline tau on the eval split (greedy, pooled) per k; at k = {k} also at each "
             "temperature, outside trailing loops and per benchmark set.", "",
             "| variant | overrides | " + " | ".join(f"k = {x}" for x in ks) + " | "
             + "".join(f"T = {t} | " for t in temps) + "outside loops | " + "".join(f"{s} | " for s in sets)
             + "train tokens | train time |",
             "|---|---|" + "---|" * (len(ks) + len(temps) + 1 + len(sets) + 2)]
    for r in rows:
        overrides = ", ".join(f"{key}={value}" for key, value in r["overrides"].items()) or "(the recipe)"
        lines.append(f"| {'**' + r['name'] + '**' if r['name'] == table['winner'] else r['name']} | {overrides} | "
                     + " | ".join(f"{r['tau'][x]:.3f}" for x in ks) + " | "
                     + "".join(f"{r['tau_at'][t]:.3f} | " for t in temps) + f"{r['outside_loops_tau']:.3f} | "
                     + "".join(f"{r['benchmarks'][s]:.3f} | " for s in sets)
                     + f"{r['train_tokens']} | {r['train_seconds'] / 60:.1f} min |")
    return lines


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _cell(cell: dict) -> str:
    return f"{cell['speedup']:.2f}x +-{100 * cell['spread']:.0f}%" + (" *" if cell["noisy"] else "")
