"""Packed batches of hidden-state shards for the draft: inputs, soft targets and masks for every unroll step.

Positions in a packed batch: at position t of a sequence, unroll step j feeds the token x[t+1+j] and predicts
x[t+2+j]; its target is the target model's distribution at position t+1+j (softmax of the target head on the
stored final state, restricted to the draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [1, T, 3*Ht]
    final: torch.Tensor  # [T, Ht]
    positions: torch.Tensor  # [1, T] position within its own sequence
    seq_end: torch.Tensor  # [T] exclusive end index of the sequence each position belongs to
    mask: torch.Tensor  # [1, T, T] causal within each sequence

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def plan(cu_seqlens: torch.Tensor, max_tokens: int, order: list[int]) -> list[list[int]]:
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


def collate(shard: dict[str, torch.Tensor], seqs: list[int], max_tokens: int, dtype, device) -> Batch:
    cu = shard["cu_seqlens"].tolist()
    spans = [(cu[i], min(cu[i + 1], cu[i] + max_tokens)) for i in seqs]
    index = torch.cat([torch.arange(a, b) for a, b in spans])
    lengths = [b - a for a, b in spans]
    doc = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths).cumsum(0)
    t = index.numel()
    positions = torch.arange(t) - starts[doc]
    seq_end = starts[doc + 1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = causal & (doc[:, None] == doc[None, :])
    aux = shard["aux"][index].reshape(t, -1)
    return Batch(
        input_ids=shard["input_ids"][index].long().to(device), loss_mask=shard["loss_mask"][index].bool().to(device),
        aux=aux.to(device, dtype)[None], final=shard["final"][index].to(device, dtype),
        positions=positions[None].to(device), seq_end=seq_end.to(device), mask=mask[None].to(device),
    )


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[t + by] at position t, `fill` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[0]:
        out[: x.shape[0] - by] = x[by:]
    return out


def targets(batch: Batch, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor):
    """Soft targets [T, Vd] and a mask [T] of positions s whose next token is generated and whose target argmax
    lies in the draft vocabulary (the draft cannot be taught a token it does not have)."""
    t = batch.tokens
    idx = torch.arange(t, device=batch.input_ids.device)
    has_next = (idx + 1 < batch.seq_end) & shifted(batch.loss_mask, 1, False)
    rows = has_next.nonzero().squeeze(1)
    probs = torch.zeros(t, draft_ids.numel(), device=lm_head.device)
    valid = torch.zeros(t, dtype=torch.bool, device=lm_head.device)
    if rows.numel():
        logits = batch.final[rows] @ lm_head.T  # [S, V]
        valid[rows] = t2d[logits.argmax(-1)]
        probs[rows] = torch.softmax(logits[:, draft_ids].float(), -1)
    return probs, valid


def step_inputs(batch: Batch, steps: int, embed: torch.Tensor):
    """Embeddings fed at each unroll step: x[t+1+j] at position t."""
    return [embed[shifted(batch.input_ids, 1 + j)][None] for j in range(steps)]


def step_mask(batch: Batch, valid: torch.Tensor, j: int) -> torch.Tensor:
    """Positions t where step j has a target: t+1+j in the same sequence and a valid target position."""
    idx = torch.arange(batch.tokens, device=valid.device)
    return (idx + 2 + j <= batch.seq_end) & shifted(valid, 1 + j, False)
