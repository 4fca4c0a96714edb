"""Report plots (PNG, matplotlib): vocab coverage, training curves, offline vs served acceptance, served speed."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on compute nodes
import matplotlib.pyplot as plt  # noqa: E402

from .formats import atomic_path  # noqa: E402

# No "Software" key: the PNG bytes then depend only on the figure, so a rebuild gives the same file.
PNG_METADATA = {"Software": None}


def _load(path):
    return json.loads(Path(path).read_text())


def _save(fig, path) -> None:
    fig.tight_layout()  # keeps axis labels inside the image
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def coverage(coverage_path, output_path) -> None:
    """Share of generated tokens inside the draft vocabulary against the vocabulary size."""
    cov = _load(coverage_path)
    sizes = [c["size"] for c in cov["curve"]]
    shares = [100 * c["coverage"] for c in cov["curve"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, shares, marker="o")
    ax.axvline(cov["draft_vocab_size"], color="grey", linestyle="--", label=f"draft vocab {cov['draft_vocab_size']}")
    ax.set(xscale="log", xlabel="draft vocabulary size (most frequent tokens)",
           ylabel="coverage of generated tokens (%)",
           title=f"Vocabulary coverage ({cov['counted_tokens']} tokens, {cov['distinct_tokens']} distinct)")
    ticks = sorted(set(sizes) | {cov["draft_vocab_size"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])  # plain sizes, not powers of ten
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, output_path)


def training(train_log_path, output_path) -> None:
    """Loss and accuracy of every unroll step over optimizer steps."""
    records = [json.loads(line) for line in Path(train_log_path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{train_log_path}: no training records; lower train.log_every or train longer")
    steps = [r["step"] for r in records]
    fig, (loss, acc) = plt.subplots(1, 2, figsize=(11, 4))
    for j in range(len(records[0]["loss"])):
        loss.plot(steps, [r["loss"][j] for r in records], marker=".", label=f"unroll step {j}")
        acc.plot(steps, [r["acc"][j] for r in records], marker=".", label=f"unroll step {j}")
    loss.set(xlabel="optimizer step", ylabel="soft cross-entropy", title="Training loss per unroll step")
    acc.set(xlabel="optimizer step", ylabel="top-1 accuracy", ylim=(0, 1), title="Training accuracy per unroll step")
    for ax in (loss, acc):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, output_path)


def acceptance(acceptance_path, served_path, output_path) -> None:
    """Per-position acceptance offline (evaluate stage) and served (vLLM's counters), one served line per k."""
    acc, served = _load(acceptance_path), _load(served_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    positions = range(1, len(acc["per_position"]) + 1)
    ax.plot(positions, acc["per_position"], marker="o", color="black", label="offline (eval traces)")
    same = served.get("offline")
    if same:
        ax.plot(range(1, len(same["per_position"]) + 1), same["per_position"], marker="o", color="grey",
                label="offline, the text served")
    for k, r in served["k"].items():
        ax.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="s", linestyle="--",
                label=f"served, k={k}: tau {r['served_tau']:.2f} (offline, same text {_fmt(r['offline_tau'])})")
    ax.set(xlabel="draft position", ylabel="share of drafts accepted up to here", ylim=(0, 1.05),
           title="Acceptance per draft position, offline vs served")
    ax.set_xticks(list(positions))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, output_path)


def positions(acceptance_path, output_path) -> None:
    """Offline tau (pooled, k = report.position_k) per bucket of context position, one line per temperature; the
    number of start positions of each bucket under its label, empty buckets left out."""
    from .report import bucket_name, position_k

    acc = _load(acceptance_path)
    k = position_k(acc)
    buckets = acc["by_position"]
    runs = {"0 (greedy)": acc, **{t: r for t, r in acc.get("temperatures", {}).items()}}
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(buckets))
    for name, r in runs.items():
        ys = [b["tau"][str(k)] if b["positions"] else float("nan") for b in r["by_position"]]
        ax.plot(xs, ys, marker="o", label=f"T = {name}: overall {r['tau'][str(k)]:.2f}, "
                                          f"mean over requests {r['tau_request_mean'][str(k)]:.2f}")
    ax.set_xticks(list(xs), [f"{bucket_name(b)}\n({b['positions']} starts)" for b in buckets])
    ax.set(xlabel="position of the first drafted token in its conversation", ylabel=f"tau at k={k} (pooled)",
           ylim=(1, k + 1), title="Offline acceptance by context position (eval split)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, output_path)


def speedup(served_path, output_path) -> None:
    """Speedup over the target alone against batch size, one line per k (and the chosen schedule), one panel per
    temperature; 1 (the target alone) dashed."""
    served = _load(served_path)
    tables = served["speedup"]
    fig, axes = plt.subplots(1, len(tables), figsize=(5 * len(tables), 4), sharey=True, squeeze=False)
    for ax, (t, table) in zip(axes[0], tables.items()):
        sizes = [int(b) for b in table]
        for k in served["k"]:
            ax.plot(sizes, [table[b][k]["speedup"] for b in table], marker="o", label=f"k = {k}")
        if float(t) == 0 and served.get("dynamic"):
            ax.plot(sizes, [served["dynamic"][b]["speedup"] for b in table], marker="s", color="black",
                    linestyle=":", label="serving config (vllm.json)")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel="batch size (concurrent requests)", title=f"T = {t}")
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("speedup over the target alone")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"Served through vLLM ({served['max_new_tokens']} new tokens a request)")
    _save(fig, output_path)


def speedup_table(served_path, output_path) -> None:
    """The speedup table as TSV: one row per temperature, batch size and k (k `schedule`: the chosen config)."""
    served = _load(served_path)
    lines = ["temperature\tbatch_size\tk\tspeedup\tspread\tpairs\tnoisy\ttok_s\ttarget_alone_tok_s\tserved_tau"]
    rows = [(t, b, k, c) for t, table in served["speedup"].items() for b, cells in table.items()
            for k, c in cells.items()]
    rows += [("0", b, "schedule", c) for b, c in (served.get("dynamic") or {}).items()]
    for t, b, k, c in rows:
        lines.append(f"{t}\t{b}\t{k}\t{c['speedup']:.3f}\t{c['spread']:.3f}\t{c['repeats']}\t"
                     f"{'yes' if c['noisy'] else 'no'}\t{c['tok_s']:.2f}\t{c['baseline_tok_s']:.2f}\t"
                     f"{c['served_tau']:.3f}")
    with atomic_path(output_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def variants(table_path, output_path) -> None:
    """The draft variants (eaglepipe.variants' variants.json): greedy tau per k, one line per variant; tau at the
    comparison's k per figure, one bar group per variant, labelled with its training time."""
    table = _load(table_path)
    k, rows = str(table["k"]), table["variants"]
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        ks = sorted(r["tau"], key=int)
        curves.plot([int(x) for x in ks], [r["tau"][x] for x in ks], marker="o",
                    label=("* " if r["name"] == table["winner"] else "") + r["name"])
    curves.set(xlabel="draft length k", ylabel="offline tau (eval split, greedy)", title="Draft variants: tau per k")
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize="small")
    figures = [("greedy", lambda r: r["tau"][k])]
    figures += [(f"T = {t}", lambda r, t=t: r["tau_at"].get(t, float("nan"))) for t in rows[0]["tau_at"]]
    figures += [("outside loops", lambda r: r["outside_loops_tau"])]
    figures += [(s, lambda r, s=s: r["benchmarks"].get(s, float("nan"))) for s in rows[0]["benchmarks"]]
    width = 0.8 / len(figures)
    for i, (name, value) in enumerate(figures):
        bars.bar([x + i * width for x in range(len(rows))], [value(r) for r in rows], width, label=name)
    bars.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))],
                    [("* " if r["name"] == table["winner"] else "") + f"{r['name']}\n{r['train_seconds'] / 60:.1f} min"
                     for r in rows], fontsize="small")
    bars.set(ylabel=f"offline tau at k = {k}", ylim=(1, None), title=f"Draft variants at k = {k}")
    bars.grid(True, axis="y", alpha=0.3)
    bars.legend(fontsize="small")
    _save(fig, output_path)


def run(*, coverage_path, train_log, acceptance_path, served_path, outputs: dict) -> None:
    coverage(coverage_path, outputs["coverage"])
    training(train_log, outputs["training"])
    acceptance(acceptance_path, served_path, outputs["acceptance"])
    positions(acceptance_path, outputs["positions"])
    speedup(served_path, outputs["speedup"])
    speedup_table(served_path, outputs["speedup_table"])


def _fmt(tau) -> str:
    """Offline tau exists only for k up to evaluate.max_k."""
    return "-" if tau is None else f"{tau:.2f}"
