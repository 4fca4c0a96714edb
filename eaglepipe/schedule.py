"""The serving config chosen from the bench's k x batch table: vLLM's dynamic speculative decoding schedule.

vllm.json (written by the bench, `results/serve/vllm.json`):
    {"speculative_config": {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K,
                            "num_speculative_tokens_per_batch_size": [[first, last, k], ...]} or null,
     "command": the `vllm serve` line that uses it, "best_k": {batch size: k}, "temperature": the table it comes from,
     "note": what the schedule means}
Ranges are inclusive; each measured batch size covers the sizes up to the next measured one, and vLLM carries the
last range's k to any larger batch. k = 0 means no speculation at that size; null: no k beat the target alone.
"""

from __future__ import annotations

import json
import shlex

DYNAMIC_FLOOR = 0.95  # the chosen schedule confirms when it keeps this share of the best static k's speedup


def table(cells: dict[str, dict[str, dict]]) -> dict[int, dict[int, float]]:
    """Speedups by batch size then k from one temperature's cells of served.json's `speedup`."""
    return {int(b): {int(k): cell["speedup"] for k, cell in row.items()} for b, row in cells.items()}


def best_k(speedups: dict[int, float]) -> int:
    """The k with the highest speedup above 1 (the smaller k on a tie: less draft work), 0 when none beats 1."""
    winners = [(s, -k) for k, s in speedups.items() if s > 1.0]
    return -max(winners)[1] if winners else 0


def choose(table: dict[int, dict[int, float]]) -> list[list[int]]:
    """num_speculative_tokens_per_batch_size from speedups by batch size then k: [[first, last, k], ...], one range per
    run of measured batch sizes that share their best k."""
    sizes = sorted(table)
    if not sizes:
        raise ValueError("no batch size measured: the bench needs bench.batch_sizes")
    ranges = []
    for i, b in enumerate(sizes):
        k = best_k(table[b])
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else b
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = last
        else:
            ranges.append([b if ranges else 1, last, k])
    return ranges


def speculative_config(draft: str, schedule: list[list[int]]) -> dict | None:
    """vLLM's speculative_config serving the draft with this schedule; None when it never speculates."""
    top = max(k for _, _, k in schedule)
    if top == 0:
        return None
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": top,
            "num_speculative_tokens_per_batch_size": schedule}


def command(target: str, config: dict | None) -> str:
    """The `vllm serve` line that serves the target with this speculative_config (None: the target alone)."""
    line = ["vllm", "serve", str(target)]
    if config is not None:
        line += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return shlex.join(line)


def serving(target: str, draft: str, table: dict[int, dict[int, float]], temperature: float) -> dict:
    """vllm.json's content for speedups measured at this temperature."""
    schedule = choose(table)
    config = speculative_config(draft, schedule)
    note = ("no k beats the target alone at any measured batch size: serve without the draft" if config is None else
            "per batch-size range (inclusive) the k that measured fastest, 0 where no k beats the target alone; "
            "vLLM carries the last range's k to larger batches")
    return {"speculative_config": config, "command": command(target, config),
            "best_k": {str(b): best_k(table[b]) for b in sorted(table)}, "temperature": temperature, "note": note}
