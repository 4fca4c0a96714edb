"""Train stage: the EAGLE-3 draft on stored hidden states, with a training-time-test unroll.

Loss at unroll step j: soft cross-entropy between the draft's distribution and the target's distribution on the
draft vocabulary, over positions whose next token was generated, weighted by decay**j. train_log.jsonl holds one
JSON object per logging point: step, epoch, lr, loss and acc (one value per unroll step), tokens.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import vocab as vocab_map
from .batches import collate, plan, step_inputs, step_mask, targets
from .draft import DraftConfig, Eagle3Draft, save_checkpoint
from .formats import atomic_path, read_hidden_shard
from .target import load_embeddings, load_lm_head, read_info

log = logging.getLogger(__name__)


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def unroll_losses(model: Eagle3Draft, batch, embed, draft_head, t2d, steps: int):
    """Per unroll step: (loss, correct, count) over that step's valid positions."""
    probs, valid = targets(batch, draft_head, t2d)
    results = []
    for j, out in enumerate(model.unroll(batch.aux, step_inputs(batch, steps, embed), batch.positions, batch.mask)):
        rows = step_mask(batch, valid, j).nonzero().squeeze(1)
        if rows.numel() == 0:
            results.append((out.sum() * 0.0, 0, 0))
            continue
        logp = F.log_softmax(model.lm_head(out[0, rows]).float(), -1)  # logits only where there is a target
        target = probs[rows + 1 + j]
        loss = -(target * logp).sum(-1).mean()
        correct = int((logp.argmax(-1) == target.argmax(-1)).sum())
        results.append((loss, correct, rows.numel()))
    return results


def init_draft(config: DraftConfig, vocab: dict, draft_head: torch.Tensor, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(config)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        model.d2t.copy_(vocab["d2t"])
        model.t2d.copy_(vocab["t2d"])
        # Start the head where the target's is: the draft's output is meant to mimic the target's final state.
        model.lm_head.weight.copy_(draft_head)
    return model


def run(shard_paths: list[str], vocab_path, out_dir, *, target_dir, layer_ids: list[int], settings: dict,
        threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(settings["device"])
    info = read_info(target_dir)
    vocab = vocab_map.load(vocab_path)
    config = DraftConfig.from_target(info.config, draft_vocab_size=int(vocab["d2t"].numel()), aux_layer_ids=layer_ids)
    draft_head = load_lm_head(target_dir)[vocab["draft_ids"]].float()  # the target's head, draft-vocab rows
    model = init_draft(config, vocab, draft_head, settings["seed"]).to(device)
    draft_head = draft_head.to(device)
    embed = load_embeddings(target_dir).float().to(device)
    t2d = vocab["t2d"].to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=settings["weight_decay"])

    shards = [read_hidden_shard(p)[0] for p in sorted(shard_paths)]
    rng = torch.Generator().manual_seed(settings["seed"])
    max_tokens, steps, decay = settings["max_batch_tokens"], settings["ttt_steps"], settings["ttt_decay"]
    epochs = []
    for _ in range(settings["epochs"]):  # the whole schedule is fixed up front: seeded order, known length
        order = []
        for s in torch.randperm(len(shards), generator=rng).tolist():
            n = shards[s]["cu_seqlens"].numel() - 1
            order += [(s, b) for b in plan(shards[s]["cu_seqlens"], max_tokens, torch.randperm(n, generator=rng).tolist())]
        epochs.append(order)
    total = sum(map(len, epochs))
    if total == 0:
        raise ValueError("no training sequences in the hidden-state shards; check the traces stats")
    log.info("training: %d epochs, %d steps, %d unroll steps, draft vocab %d", len(epochs), total, steps,
             config.draft_vocab_size)

    out_dir = Path(out_dir)
    records, step, start, seen = [], 0, time.monotonic(), 0
    acc_sum = [[0.0, 0, 0] for _ in range(steps)]  # loss*count, correct, count since the last log line
    for epoch, order in enumerate(epochs):
        for s, seqs in order:
            batch = collate(shards[s], seqs, max_tokens, torch.float32, device)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, settings["lr"], settings["warmup_steps"])
            results = unroll_losses(model, batch, embed, draft_head, t2d, steps)
            loss = sum(decay ** j * r[0] for j, r in enumerate(results))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, settings["grad_clip"])
            opt.step()
            step += 1
            seen += batch.tokens
            for j, (l, correct, count) in enumerate(results):
                acc_sum[j][0] += float(l.detach()) * count
                acc_sum[j][1] += correct
                acc_sum[j][2] += count
            if step % settings["log_every"] == 0 or step == total:
                records.append({
                    "step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"], "tokens": seen,
                    "loss": [round(a[0] / max(a[2], 1), 5) for a in acc_sum],
                    "acc": [round(a[1] / max(a[2], 1), 5) for a in acc_sum],
                })
                acc_sum = [[0.0, 0, 0] for _ in range(steps)]
                elapsed = time.monotonic() - start
                log.info("step %d/%d epoch %d: loss %.3f acc@0 %.3f acc@%d %.3f, %.0f tok/s, ETA %.0fs", step,
                         total, epoch, records[-1]["loss"][0], records[-1]["acc"][0], steps - 1,
                         records[-1]["acc"][-1], seen / elapsed, elapsed / step * (total - step))
    save_checkpoint(model, out_dir)
    with atomic_path(out_dir / "train_log.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
