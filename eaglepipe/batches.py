"""Packed batches of hidden-state shards for the draft: inputs, soft targets and masks for every unroll step.

Positions in a packed batch: at position t of a sequence, unroll step j feeds the token x[t+1+j] and predicts
x[t+2+j]; its target is the target model's distribution at position t+1+j (softmax of the target head on the
stored final state, restricted to the draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from .draft import Packing
from .formats import dequantize, shard_dtype, shard_keys


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [1, T, 3*Ht]
    final: torch.Tensor  # [T, Ht]
    positions: torch.Tensor  # [1, T] position within its own sequence
    seq_end: torch.Tensor  # [T] exclusive end index of the sequence each position belongs to
    doc: torch.Tensor  # [T] index of the sequence each position belongs to
    # With collate(..., t2d=, steps=): the loss positions, computed on the host (no device sync in the loop).
    valid: torch.Tensor | None = None  # [T] bool, see targets()
    step_rows: torch.Tensor | None = None  # [R] int64: positions with a target at step 0, then step 1, ...
    step_counts: list[int] | None = None  # rows per unroll step (sums to R)
    valid_rows: torch.Tensor | None = None  # valid.nonzero()
    step_of: torch.Tensor | None = None  # [R] the unroll step of each of step_rows
    _packing: Packing | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def packing(self) -> Packing:
        """The document structure every unroll step attends with (built once per batch)."""
        if self._packing is None:
            self._packing = Packing(self.doc)
        return self._packing

    @property
    def mask(self) -> torch.Tensor:
        """[1, T, T] causal within each sequence (dense; built on first use)."""
        return self.packing.dense_mask()


def pack(cu_seqlens: torch.Tensor, max_tokens: int, order: list[int]) -> list[list[int]]:
    """Group sequence indices (in the given order) into batches of at most max_tokens tokens."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    batches, current, size = [], [], 0
    for i in order:
        n = min(lengths[i], max_tokens)
        if current and size + n > max_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        batches.append(current)
    return batches


def collate(shard: dict[str, torch.Tensor], seqs: list[int], max_tokens: int, dtype, device, *, t2d=None,
            steps: int = 0) -> Batch:
    """The packed batch of sequences `seqs` (each cut to max_tokens). With t2d (host bool [V]) and steps, the loss
    positions of every unroll step are computed here on the host (valid, step_rows, step_counts). Host tensors go
    to a CUDA device through pinned memory, asynchronously; fp8 states go as they are stored (half the bytes) and
    are dequantized there."""
    device = torch.device(device)
    cu = shard["cu_seqlens"].tolist()
    spans = [(cu[i], min(cu[i + 1], cu[i] + max_tokens)) for i in seqs]
    index = torch.cat([torch.arange(a, b) for a, b in spans])
    lengths = [b - a for a, b in spans]
    doc = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths).cumsum(0)
    t = index.numel()
    positions = torch.arange(t) - starts[doc]
    seq_end = starts[doc + 1]
    # Every sequence of the shard, whole and in order (a batch read_sequences made): its rows are the batch as they
    # are, with no gather, and already pinned where it pinned them.
    whole = seqs == list(range(len(cu) - 1)) and all(b == cu[i + 1] for i, (_, b) in enumerate(spans))
    take = (lambda x: x) if whole else (lambda x: x[index])
    input_ids = take(shard["input_ids"]).long()
    loss_mask = take(shard["loss_mask"]).bool()
    host = {"input_ids": input_ids, "loss_mask": loss_mask, "aux": take(shard["aux"]), "final": take(shard["final"]),
            "positions": positions[None], "seq_end": seq_end, "doc": doc}
    for key in ("aux_scale", "final_scale"):
        if key in shard:
            host[key] = take(shard[key])
    counts = None
    if t2d is not None:
        idx = torch.arange(t)
        valid = (idx + 1 < seq_end) & shifted(loss_mask, 1, False) & t2d.cpu()[shifted(input_ids, 1)]
        rows = [((idx + 2 + j <= seq_end) & shifted(valid, 1 + j, False)).nonzero().squeeze(1) for j in range(steps)]
        counts = [r.numel() for r in rows]
        host["valid"] = valid
        host["valid_rows"] = valid.nonzero().squeeze(1)
        host["step_rows"] = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        host["step_of"] = torch.repeat_interleave(torch.arange(steps), torch.tensor(counts, dtype=torch.int64))
    cuda = device.type == "cuda"
    moved = {k: (v.pin_memory() if cuda else v).to(device, non_blocking=cuda) for k, v in host.items()}
    for key in ("aux", "final"):
        moved[key] = dequantize(moved[key], moved.pop(f"{key}_scale", None), dtype)
    moved["aux"] = moved["aux"].reshape(t, -1)[None]
    return Batch(**moved, step_counts=counts)


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[t + by] at position t, `fill` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[0]:
        out[: x.shape[0] - by] = x[by:]
    return out


def targets(batch: Batch, draft_head: torch.Tensor, t2d: torch.Tensor):
    """Soft targets [T, Vd] and a mask [T] of positions s whose next token was generated by the target and lies in
    the draft vocabulary (the draft cannot be taught a token it does not have). For greedy traces the generated token
    is the target's argmax, so this is the argmax test without computing logits over the whole target vocabulary."""
    t = batch.tokens
    if batch.valid is not None:  # computed by collate on the host: no device sync here
        valid, rows = batch.valid, batch.valid_rows
    else:
        idx = torch.arange(t, device=batch.input_ids.device)
        next_ids = shifted(batch.input_ids, 1)
        valid = (idx + 1 < batch.seq_end) & shifted(batch.loss_mask, 1, False) & t2d[next_ids]
        rows = valid.nonzero().squeeze(1)
    probs = torch.zeros(t, draft_head.shape[0], device=draft_head.device)  # draft_head: target head rows [Vd, H]
    if rows.numel():
        probs[rows] = torch.softmax((batch.final[rows] @ draft_head.T).float(), -1)  # float32 also under autocast
    return probs, valid


def step_inputs(batch: Batch, steps: int, embed: torch.Tensor):
    """Embeddings fed at each unroll step: x[t+1+j] at position t, in float32 (the table may be kept in its
    checkpoint's bf16: the rows are then the same numbers)."""
    return [embed[shifted(batch.input_ids, 1 + j)][None].float() for j in range(steps)]


def step_mask(batch: Batch, valid: torch.Tensor, j: int) -> torch.Tensor:
    """Positions t where step j has a target: t+1+j in the same sequence and a valid target position."""
    idx = torch.arange(batch.tokens, device=valid.device)
    return (idx + 2 + j <= batch.seq_end) & shifted(valid, 1 + j, False)


def sequence_lengths(path) -> torch.Tensor:
    """cu_seqlens of a hidden-state shard, read without loading its states."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("cu_seqlens")


def read_sequences(path, seqs: list[int], max_tokens: int, *,
                   pin: bool = False) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Only the rows of sequences `seqs` of a shard (each cut to max_tokens), as a shard of their own; returns it
    with the sequences' indices in it. Reads through a memory map, so a job never holds more than its batch. Each
    sequence's rows are copied once into a buffer of the whole batch, in pinned memory with `pin` (for an
    asynchronous copy to a CUDA device; collate then neither gathers nor pins them again)."""
    with safe_open(str(path), framework="pt") as f:
        cu = f.get_tensor("cu_seqlens").tolist()
        spans = [(cu[i], min(cu[i + 1], cu[i] + max_tokens)) for i in seqs]
        total = sum(b - a for a, b in spans)
        shard = {}
        for key in shard_keys(shard_dtype(path)):
            if key == "cu_seqlens":
                continue
            view = f.get_slice(key)
            out = None
            at = 0
            for a, b in spans:
                part = view[a:b]
                if out is None:
                    out = torch.empty((total, *part.shape[1:]), dtype=part.dtype, pin_memory=pin)
                out[at:at + b - a] = part
                at += b - a
            shard[key] = out
    shard["cu_seqlens"] = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
    return shard, list(range(len(seqs)))
