"""Vocab stage: the draft vocabulary (most frequent generated tokens) and its mapping to the target's.

vocab_map.safetensors:
    d2t        int64 [draft_vocab_size]  offsets: target_id = i + d2t[i] for draft token i (the serving convention)
    t2d        bool  [target_vocab]      True where the target token is in the draft vocabulary
    token_freq int64 [target_vocab]      occurrences of each token among the train rows' loss-span tokens (every
                                         generated turn in multi_turn `all`); coverage.json is over the same tokens
"""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file, save_file

from .formats import TRACE_SCHEMA, atomic_path, read_table, rebuild, write_json

log = logging.getLogger(__name__)


def loss_tokens(row: dict) -> list[int]:
    """The tokens of a trace row the draft is trained to predict: its stream inside the loss spans (in multi_turn
    `all`, earlier regenerated turns as well as the last; in `last`, exactly output_ids)."""
    stream = list(row["prompt_ids"]) + list(row["output_ids"])
    spans = row["loss_spans"]
    if spans is None or len(spans) % 2 or any(not 0 <= a <= b <= len(stream) for a, b in zip(spans[::2], spans[1::2])):
        raise ValueError(f"row {row['id']}: loss_spans {spans} are not [start, end) pairs within its "
                         f"{len(stream)}-token stream; rerun the traces")
    return [t for a, b in zip(spans[::2], spans[1::2]) for t in stream[a:b]]


def count_tokens(trace_paths: list[str], vocab_size: int) -> torch.Tensor:
    """Occurrences of each token among the loss-span tokens of the usable rows (the rows hidden_states keeps)."""
    freq = torch.zeros(vocab_size, dtype=torch.int64)
    for path in trace_paths:
        for row in read_table(path, TRACE_SCHEMA):
            if row["error"] or not row["output_ids"]:  # hidden_states drops these rows: nothing of them is learned
                continue
            try:
                tokens = loss_tokens(row)
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
            if not tokens:
                continue
            ids = torch.tensor(tokens, dtype=torch.int64)
            if int(ids.max()) >= vocab_size:
                raise ValueError(f"{path}: row {row['id']} has token id {int(ids.max())} >= target vocab "
                                 f"{vocab_size}; traces and target do not match, rerun the traces")
            freq += torch.bincount(ids, minlength=vocab_size)
    return freq


def select(freq: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary, sorted; by frequency, ties to the lower id."""
    if draft_vocab_size > freq.numel():
        raise ValueError(f"config key vocab.draft_vocab_size: {draft_vocab_size} exceeds the target's vocabulary "
                         f"({freq.numel()})")
    # Stable sort on -freq keeps ids ascending among equal counts: deterministic ties.
    order = torch.sort(-freq, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def coverage(freq: torch.Tensor, size: int) -> float:
    total = int(freq.sum())
    return float(torch.sort(freq, descending=True).values[:size].sum()) / total if total else 0.0


def run(trace_paths: list[str], map_path, coverage_path, *, target_vocab: int, draft_vocab_size: int,
        curve_sizes: list[int]) -> None:
    freq = count_tokens(trace_paths, target_vocab)
    ids = select(freq, draft_vocab_size)
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ids] = True
    with atomic_path(map_path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "token_freq": freq}, str(tmp))
    sizes = sorted({s for s in curve_sizes if s <= target_vocab} | {draft_vocab_size})
    report = {
        "draft_vocab_size": draft_vocab_size, "target_vocab_size": target_vocab,
        "coverage": coverage(freq, draft_vocab_size), "counted_tokens": int(freq.sum()),
        "distinct_tokens": int((freq > 0).sum()),
        "curve": [{"size": s, "coverage": coverage(freq, s)} for s in sizes],
    }
    write_json(coverage_path, report)
    log.info("draft vocab %d covers %.2f%% of %d generated tokens (%d distinct)", draft_vocab_size,
             100 * report["coverage"], report["counted_tokens"], report["distinct_tokens"])


def load(map_path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(map_path))
    d2t = tensors["d2t"]
    ids = torch.arange(d2t.numel()) + d2t
    if not torch.equal(tensors["t2d"].nonzero().squeeze(1), ids):
        raise ValueError(f"{map_path}: d2t and t2d disagree; rebuild it with {rebuild(map_path)}")
    tensors["draft_ids"] = ids
    return tensors
