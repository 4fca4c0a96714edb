"""Train stage: the EAGLE-3 draft on stored hidden states, with a training-time-test unroll, on one process or
several (torchrun, DDP), resumable from checkpoints.

Loss at unroll step j (train.loss): soft cross-entropy between the draft's distribution and the target's distribution
on the draft vocabulary, or the LK loss (row_losses), over positions whose next token was generated, weighted by
decay**j. train_log.jsonl holds one JSON object per logging point: step, epoch, lr, loss and acc (one value per unroll
step), tokens; with train.select: tau also held_back_tau3 where the held-back slice was scored, and the last record
selected_step, the step whose weights were kept.

Data order: the whole schedule of global batches is fixed up front from the seed (shards in a seeded order, the
sequences of each shard in a seeded order, packed into batches of at most max_batch_tokens). With N processes rank r
takes sequences r, r+N, ... of every global batch, reads only those rows from the shard, and its loss is scaled so
that DDP's gradient average equals the single-process gradient of the whole global batch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import provenance
from . import vocab as vocab_map
from .batches import collate, pack, read_sequences, sequence_lengths, step_inputs, step_mask, targets
from .compiled import token_axis_dynamic
from .draft import DraftConfig, Eagle3Draft, save_checkpoint
from .formats import LAYER_CONVENTION, atomic_path, common_dtype
from .target import fingerprint as target_fingerprint, fingerprint_parts
from .target import load_embeddings, load_lm_head, read_info

log = logging.getLogger(__name__)

# Settings that change neither the result nor the schedule: a checkpoint made under other values still applies.
NOT_IN_RESUME_KEY = ("threads", "checkpoint_every", "gpus", "processes")


SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step: int, total: int, lr: float, warmup: int, schedule: str = "cosine") -> float:
    """Linear warmup to lr over `warmup` steps, then cosine or linear decay to 10 % of lr at the last step, or lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "cosine":
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    if schedule == "linear":
        return lr * (1 - 0.9 * progress)
    if schedule == "constant":
        return lr
    raise ValueError(f"config key train.schedule: {schedule!r}; expected one of {', '.join(SCHEDULES)}")


# Rows of logits per chunk of the loss: CHUNK_ELEMENTS // draft vocabulary (256 MiB of float32 logits).
CHUNK_ELEMENTS = 2 ** 26
PATHS = ("chunked", "reference")
LOSSES = ("soft_ce", "lk")
LK_ETA = 3.0  # the LK paper's best eta for the adaptive KL weight


def row_losses(logits: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """Per row the loss of the draft's logits [R, Vd] against the target's probabilities [R, Vd] on the draft vocabulary
    (rows may sum to less than 1: the target's mass outside it). soft_ce: sum_v p_v (logsumexp - logit_v). lk: the
    hybrid LK loss of Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding"
    (arXiv 2602.23881): lambda * CE + (1 - lambda) * (1 - alpha), with alpha = sum_v min(p_v, q_v) the acceptance
    rate of a draft q against p and lambda = exp(-LK_ETA * alpha) held constant (the paper's KL, up to p's entropy,
    which has no gradient)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    ce = (target * (lse - logits)).sum(-1)
    if loss == "soft_ce":
        return ce
    if loss == "lk":
        alpha = torch.minimum(target, torch.exp(logits - lse)).sum(-1)
        weight = torch.exp(-LK_ETA * alpha.detach())
        return weight * ce + (1 - weight) * (1 - alpha)
    raise ValueError(f"config key train.loss: {loss!r}; expected one of {', '.join(LOSSES)}")


def soft_ce_rows(products, rows, weight, probs):
    """The soft cross-entropy of a chunk of loss rows from their logits products [R, Vd] (in the product dtype), the
    rows of the soft targets probs they are taught (rows [R]) and their weights [R]: (loss [R] float32, whether the
    argmax agrees with the target's [R] bool, the weighted gradient with respect to the logits [R, Vd] in the products'
    dtype). Logits and softmax in float32."""
    logits = products.float()
    target = probs[rows].float()
    correct = logits.argmax(-1) == target.argmax(-1)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    mass = target.sum(-1, keepdim=True)
    per_row = (target * (lse - logits)).sum(-1)
    # d CE / d logits = softmax * sum(target) - target, times each row's weight.
    grad = ((torch.exp(logits - lse) * mass - target) * weight[:, None]).to(products.dtype)
    return per_row, correct, grad


def lk_rows(products, rows, weight, probs):
    """The LK loss (row_losses' lk) of a chunk of loss rows, in soft_ce_rows' form: (loss [R] float32, whether the
    argmax agrees with the target's [R] bool, the weighted gradient with respect to the logits [R, Vd]). With q the
    draft's softmax, p the target, m = sum p, alpha = sum min(p, q) and lambda = exp(-LK_ETA * alpha) held constant:
    d/dlogits = lambda * (q * m - p) - (1 - lambda) * q * (s - sum(s * q)), where s is 1 where q < p (the minimum's
    gradient reaches q there), 1/2 where they tie (as torch.minimum's gradient splits) and 0 elsewhere."""
    logits = products.float()
    target = probs[rows].float()
    correct = logits.argmax(-1) == target.argmax(-1)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    q = torch.exp(logits - lse)
    ce = (target * (lse - logits)).sum(-1)
    alpha = torch.minimum(target, q).sum(-1)
    lam = torch.exp(-LK_ETA * alpha)[:, None]
    per_row = lam[:, 0] * ce + (1 - lam[:, 0]) * (1 - alpha)
    s = (q < target).to(q.dtype) + 0.5 * (q == target).to(q.dtype)
    d_alpha = q * (s - (s * q).sum(-1, keepdim=True))
    grad = lam * (q * target.sum(-1, keepdim=True) - target) - (1 - lam) * d_alpha
    return per_row, correct, (grad * weight[:, None]).to(products.dtype)


LOSS_ROWS = {"soft_ce": soft_ce_rows, "lk": lk_rows}


@functools.lru_cache(maxsize=None)
def loss_kernel(loss: str = "soft_ce", backend=None):
    """The rows function of a loss (LOSS_ROWS), eager (None) or compiled by a torch.compile backend ("inductor" with
    train.compile): one generated kernel reads a chunk's logits and targets twice (the row reductions, then the
    gradient) where eager makes a float32 pass over [R, Vd] per operation. The row axis of products, rows, weight and
    probs is symbolic, so the last, shorter chunk and a new batch compile nothing."""
    if loss not in LOSS_ROWS:
        raise ValueError(f"config key train.loss: {loss!r}; expected one of {', '.join(LOSSES)}")
    return LOSS_ROWS[loss] if backend is None else token_axis_dynamic(LOSS_ROWS[loss], backend, 4)


class ChunkedLoss(torch.autograd.Function):
    """sum_r weight[r] * row_losses(hidden[r] @ head^T, probs[target_rows[r]]) with the logits of a chunk of rows at a
    time. The loss is a scalar, so the gradients are computed in the forward pass chunk by chunk and only scaled in
    the backward: neither the logits nor their gradients outlive a chunk. The products run in hidden's dtype (the
    autocast dtype), logits and softmax in float32, as the reference path does. Also returns per row the loss and
    whether the argmax agrees with the target's (not differentiable). backend: each chunk's loss rows (loss_kernel)
    compiled by this torch.compile backend, or eager (None)."""

    @staticmethod
    def forward(ctx, hidden, head, probs, target_rows, weight, chunk: int, loss: str = "soft_ce", backend=None):
        rows = hidden.shape[0]
        dtype = hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = head.to(dtype)
            grad_h = torch.empty_like(hidden)
            grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
            per_row = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
            rows_loss = loss_kernel(loss, backend)
            for a in range(0, rows, chunk):
                h = hidden[a:a + chunk]
                per_row[a:a + chunk], correct[a:a + chunk], g = rows_loss(h @ w.T, target_rows[a:a + chunk],
                                                                          weight[a:a + chunk], probs)
                grad_h[a:a + chunk] = g @ w
                grad_w += (g.T @ h).float()
            total = (per_row * weight).sum()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(per_row, correct)
        return total, per_row, correct

    @staticmethod
    def backward(ctx, grad_loss, _per_row, _correct):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss, None, None, None, None, None, None


class Objective(torch.nn.Module):
    """The weighted unroll loss (LOSSES, row_losses) of one rank's part of a global batch; a module so that DDP can
    wrap it. path="chunked": logits of every unroll step's loss rows in one ChunkedLoss after the unroll (needs a batch
    collated with t2d and steps); "reference": per step full logits held for the backward, the original path (the
    naive baseline of eaglepipe.tools.bench_train). compile: the torch.compile backend of the chunked loss rows
    (loss_kernel) and of the draft layer's elementwise steps (Eagle3Draft.compile_steps; "inductor" with
    train.compile), or None: eager."""

    def __init__(self, model: Eagle3Draft, path: str = "chunked", loss: str = "soft_ce", compile=None):
        super().__init__()
        if path not in PATHS:
            raise ValueError(f"path {path!r}: expected one of {', '.join(PATHS)}")
        if loss not in LOSSES:
            raise ValueError(f"config key train.loss: {loss!r}; expected one of {', '.join(LOSSES)}")
        self.model = model
        self.path = path
        self.loss = loss
        self.compile = compile
        model.compile_steps(compile)

    def forward(self, batch, embed, probs, valid, denominators: list[float], decay: float, scale: float):
        """Returns (loss, stats [steps, 3] float64: loss sum, correct, count per unroll step); loss = scale *
        sum_j decay**j * (loss sum_j / denominators[j]), so with scale = world size DDP's average is the global
        batch's loss."""
        model = self.model
        steps = len(denominators)
        if batch is None:  # this rank has no sequence in the batch: it still joins the gradient average, with zeros
            loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            return loss, torch.zeros(steps, 3, dtype=torch.float64, device=loss.device)
        if self.path == "reference" or batch.step_rows is None:
            return self._reference(batch, embed, probs, valid, denominators, decay, scale)
        device = batch.input_ids.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        rows = batch.step_rows.split(batch.step_counts)
        hidden = []
        for j, out in enumerate(model.unroll(batch.aux, step_inputs(batch, steps, embed), batch.positions,
                                             batch.packing)):
            h = out[0, rows[j]]
            hidden.append(h.to(dtype) if dtype else h)
        coef = torch.tensor([scale * decay ** j / max(d, 1.0) for j, d in enumerate(denominators)],
                            dtype=torch.float32).to(device, non_blocking=True)
        chunk = max(1, CHUNK_ELEMENTS // model.config.draft_vocab_size)
        loss, per_row, correct = ChunkedLoss.apply(torch.cat(hidden), model.lm_head.weight, probs,
                                                   batch.step_rows + 1 + batch.step_of, coef[batch.step_of], chunk,
                                                   self.loss, self.compile)
        stats = torch.zeros(steps, 3, dtype=torch.float64, device=device)
        stats[:, 0].index_add_(0, batch.step_of, per_row.double())
        stats[:, 1].index_add_(0, batch.step_of, correct.double())
        stats[:, 2] = torch.tensor(batch.step_counts, dtype=torch.float64)
        return loss, stats

    def _reference(self, batch, embed, probs, valid, denominators, decay, scale):
        model = self.model
        loss, stats = 0.0, []
        for j, out in enumerate(model.unroll(batch.aux, step_inputs(batch, len(denominators), embed),
                                             batch.positions, batch.packing)):
            rows = step_mask(batch, valid, j).nonzero().squeeze(1)
            if rows.numel() == 0:  # keep every parameter in the graph: DDP expects a gradient for each
                loss = loss + (out.sum() + model.lm_head.weight.sum()) * 0.0
                stats.append((0.0, 0, 0))
                continue
            logits = model.lm_head(out[0, rows]).float()  # logits only where there is a target
            target = probs[rows + 1 + j]
            if self.loss == "soft_ce":
                logp = F.log_softmax(logits, -1)
                total = -(target * logp).sum()
            else:
                total = row_losses(logits, target, self.loss).sum()
            correct = int((logits.argmax(-1) == target.argmax(-1)).sum())
            loss = loss + decay ** j * total / max(denominators[j], 1.0)
            stats.append((float(total.detach()), correct, rows.numel()))
        return loss * scale, torch.tensor(stats, dtype=torch.float64, device=batch.input_ids.device)


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


def _draw(n: int, settings: dict, shard: int) -> list[int]:
    """The seeded order of a shard's n sequences that data_fraction and the held-back slice are taken from."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(settings["seed"] * 1_000_003 + shard)).tolist()


def held_back(cu_seqlens: list[torch.Tensor], settings: dict) -> list[list[int]] | None:
    """With train.select: tau, the sequences of each shard held back from training to score the checkpoints: the
    last train.select_fraction of the seeded order (at least one, never a shard's only sequence), sorted; else None."""
    if settings.get("select", "last") != "tau":
        return None
    held = []
    for s, cu in enumerate(cu_seqlens):
        n = cu.numel() - 1
        k = min(n - 1, max(1, round(settings["select_fraction"] * n)))
        held.append(sorted(_draw(n, settings, s)[n - k:]) if k > 0 else [])
    if not any(held):
        raise ValueError("config key train.select: tau holds back part of each train shard, but every shard holds a "
                         "single sequence; set train.select: last or write more sequences per shard")
    return held


def kept_sequences(cu_seqlens: list[torch.Tensor], settings: dict) -> list[list[int]] | None:
    """The sequences of each shard that training uses: all (None), or with train.data_fraction < 1 a random subset
    of each shard from the seed (at least one sequence), sorted; a smaller fraction's subset lies inside a larger's.
    The held-back slice of train.select: tau is never among them."""
    fraction = settings.get("data_fraction", 1.0)
    held = held_back(cu_seqlens, settings)
    if fraction >= 1 and held is None:
        return None
    kept = []
    for s, cu in enumerate(cu_seqlens):
        n = cu.numel() - 1
        order = _draw(n, settings, s)[:n - len(held[s])] if held else _draw(n, settings, s)
        kept.append(sorted(order[:max(1, round(fraction * len(order)))]))
    return kept


def schedule(cu_seqlens: list[torch.Tensor], settings: dict) -> list[tuple[int, int, list[int]]]:
    """Every global batch in training order as (epoch, shard index, sequence indices), from the seed alone."""
    rng = torch.Generator().manual_seed(settings["seed"])
    kept = kept_sequences(cu_seqlens, settings)
    keep = None if kept is None else [set(k) for k in kept]
    order = []
    for epoch in range(settings["epochs"]):
        for s in torch.randperm(len(cu_seqlens), generator=rng).tolist():
            n = cu_seqlens[s].numel() - 1
            perm = torch.randperm(n, generator=rng).tolist()
            if keep is not None:  # the same draws as with all sequences: the full run's order is unchanged
                perm = [i for i in perm if i in keep[s]]
            order += [(epoch, s, b) for b in pack(cu_seqlens[s], settings["max_batch_tokens"], perm)]
    return order


def resume_key(settings: dict, world: int, files: list) -> str:
    """What a checkpoint must agree with to be resumed: settings, process count, and the input files' bytes."""
    h = hashlib.sha256(json.dumps([{k: v for k, v in sorted(settings.items()) if k not in NOT_IN_RESUME_KEY},
                                   world], sort_keys=True).encode())
    for path in files:
        h.update(Path(path).read_bytes())  # small files (manifest with the shards' sha256, vocab map)
    return h.hexdigest()


def state_hash(model: Eagle3Draft) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def run(shard_paths: list[str], vocab_path, out_dir, *, target_dir, layer_ids: list[int], settings: dict,
        threads: int, key_files: list = (), progress_dir=None, weights_out=None) -> Eagle3Draft:
    """Train and write model.safetensors, config.json, train_log.jsonl to out_dir (rank 0 only). Under torchrun the
    process group must be initialised; every rank returns the same trained model. weights_out: a folder where each
    rank saves its float32 weights as rank-<r>.pt (to compare ranks and runs)."""
    torch.set_num_threads(threads)
    # train.variants are trainings of their own (rules/variants.smk), not a setting of this one.
    settings = {k: v for k, v in settings.items() if k != "variants"}
    shard_paths = sorted(map(str, shard_paths))
    states_dtype = common_dtype(shard_paths)  # mixed bf16 and fp8 shards are refused, the odd shard named
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device(settings["device"])
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    info = read_info(target_dir)
    vocab = vocab_map.load(vocab_path)
    config = DraftConfig.from_target(info.config, draft_vocab_size=int(vocab["d2t"].numel()), aux_layer_ids=layer_ids,
                                     fc_norm=settings.get("fc_norm", False))
    draft_head = load_lm_head(target_dir)[vocab["draft_ids"]].float()  # the target's head, draft-vocab rows
    model = init_draft(config, vocab, draft_head, settings["seed"]).to(device)
    draft_head = draft_head.to(device)
    # Kept in the checkpoint's dtype (bf16 for real targets: half the memory); step_inputs reads rows as float32.
    embed = load_embeddings(target_dir).to(device)
    t2d_host = vocab["t2d"]
    t2d = t2d_host.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, device, settings.get("optimizer", "adamw"), head=model.lm_head.weight, lr=settings["lr"],
                    weight_decay=settings["weight_decay"])

    cus = [sequence_lengths(p) for p in shard_paths]
    batches = schedule(cus, settings)
    held = held_back(cus, settings)
    total = len(batches)
    if total == 0:
        raise ValueError("no training sequences in the hidden-state shards; check the traces stats")
    max_tokens, steps, decay = settings["max_batch_tokens"], settings["ttt_steps"], settings["ttt_decay"]

    out_dir = Path(out_dir)
    progress_dir = Path(progress_dir) if progress_dir else out_dir / ".progress"
    key = resume_key(settings, world, list(key_files))
    records, step, seen = [], 0, 0
    acc_sum = [[0.0, 0, 0] for _ in range(steps)]  # loss sum, correct, count since the last log line
    scored, best = {}, None  # train.select: tau: held-back tau per scored step; the best step, its tau and weights
    resumed = load_progress(progress_dir, key, model, opt)
    if resumed:
        step, seen, records, acc_sum = resumed["step"], resumed["seen"], resumed["records"], resumed["acc_sum"]
        scored, best = resumed.get("scored", {}), resumed.get("best")
        log.info("resuming from the checkpoint at step %d of %d in %s", step, total, progress_dir)
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    log.info("training: %d epochs, %d steps, %d unroll steps, draft vocab %d, %d process(es), rank %d on %s, "
             "%s hidden states%s", settings["epochs"], total, steps, config.draft_vocab_size, world, rank, where,
             states_dtype, ", compiled loss" if settings.get("compile") else "")

    objective = Objective(model, loss=settings.get("loss", "soft_ce"),
                          compile="inductor" if settings.get("compile") else None)
    if world > 1:
        objective = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
    start, first, seen_before = time.monotonic(), step, seen
    every = settings["checkpoint_every"]

    def load(index: int):
        """Rows of this rank's sequences of global batch `index`, collated on the device (None: no sequence)."""
        _, s, seqs = batches[index]
        mine = seqs[rank::world]
        if not mine:
            return None
        rows, local = read_sequences(shard_paths[s], mine, max_tokens, pin=device.type == "cuda")
        return collate(rows, local, max_tokens, torch.float32, device, t2d=t2d_host, steps=steps)

    # On CUDA the next batch is read from the memory-mapped shard and copied (pinned, asynchronously) on a thread
    # while the device computes this one; on CPU that would only take cores from the step, so it is done in line.
    prefetch = concurrent.futures.ThreadPoolExecutor(1) if device.type == "cuda" else None
    pending = prefetch.submit(load, step) if prefetch and step < total else None
    running = None  # loss sum, correct, count per unroll step since the last fold into acc_sum (on the device)
    for epoch, s, seqs in batches[step:]:
        if pending is not None:
            batch = pending.result()
            pending = prefetch.submit(load, step + 1) if step + 1 < total else None
        else:
            batch = load(step)
        probs = valid = None
        if batch is not None:
            with autocast(device, settings["precision"]):
                probs, valid = targets(batch, draft_head, t2d)
            counts = torch.tensor(batch.step_counts, dtype=torch.float64)
        else:
            counts = torch.zeros(steps, dtype=torch.float64)
        counts = all_sum(counts, device)  # the global batch's positions per unroll step: each rank's denominator
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, settings["lr"], settings["warmup_steps"],
                                settings.get("schedule", "cosine"))
        opt.zero_grad(set_to_none=True)  # before the forward pass: last step's gradients are not held beside it
        with autocast(device, settings["precision"]):
            loss, stats = objective(batch, embed, probs, valid, counts.tolist(), decay, float(world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings["grad_clip"])
        opt.step()
        step += 1
        lengths = (cus[s][1:] - cus[s][:-1]).clamp(max=max_tokens)
        seen += int(lengths[seqs].sum())
        running = stats.detach() if running is None else running + stats.detach()
        fold = step % settings["log_every"] == 0 or step == total or (every and step % every == 0)
        if fold:  # the same steps on every rank (a collective); the device is synchronised only here
            for j, (loss_sum, correct, count) in enumerate(all_sum(running, device).tolist()):
                acc_sum[j][0] += loss_sum
                acc_sum[j][1] += int(correct)
                acc_sum[j][2] += int(count)
            running = None
        if held is not None and (step % settings["select_every"] == 0 or step == total):
            scored[step] = held_back_tau(model, shard_paths, held, embed, max_tokens, device)
            if best is None or scored[step] > best["tau"]:
                best = {"step": step, "tau": scored[step],
                        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
            log.info("step %d: held-back tau(3) %.3f (best %.3f at step %d)", step, scored[step], best["tau"],
                     best["step"])
        if step % settings["log_every"] == 0 or step == total:
            records.append({
                "step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"], "tokens": seen,
                "loss": [round(a[0] / max(a[2], 1), 5) for a in acc_sum],
                "acc": [round(a[1] / max(a[2], 1), 5) for a in acc_sum],
            })
            acc_sum = [[0.0, 0, 0] for _ in range(steps)]
            elapsed = max(time.monotonic() - start, 1e-9)
            if rank == 0:
                log.info("step %d/%d epoch %d: loss %.3f acc@0 %.3f acc@%d %.3f, %.0f tok/s, ETA %.0fs", step,
                         total, epoch, records[-1]["loss"][0], records[-1]["acc"][0], steps - 1,
                         records[-1]["acc"][-1], (seen - seen_before) / elapsed,
                         elapsed / (step - first) * (total - step))
        if rank == 0 and every and step % every == 0 and step < total:
            save_progress(progress_dir, key, model, opt, step=step, seen=seen, records=records, acc_sum=acc_sum,
                          **({"scored": scored, "best": best} if held is not None else {}))
    if prefetch:
        prefetch.shutdown()
    if held is not None:
        for r in records:
            if r["step"] in scored:
                r["held_back_tau3"] = round(scored[r["step"]], 5)
        records[-1]["selected_step"] = best["step"]
        if best["step"] != step:
            model.load_state_dict(best["state"])
        log.info("kept the weights of step %d of %d: held-back tau(3) %.3f (last step %.3f)", best["step"], step,
                 best["tau"], scored[step])
    log.info("rank %d of %d: final weights sha256 %s", rank, world, state_hash(model))
    if weights_out:
        Path(weights_out).mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(weights_out) / f"rank-{rank}.pt")
    if rank == 0:
        save_checkpoint(model, out_dir, provenance.record(
            layer_ids=layer_ids, layer_convention=LAYER_CONVENTION, vocab=vocab,
            target_fingerprint=target_fingerprint(target_dir), settings=settings,
            target_parts=fingerprint_parts(target_dir)))
        with atomic_path(out_dir / "train_log.jsonl") as tmp:
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        shutil.rmtree(progress_dir, ignore_errors=True)  # the outputs are complete: nothing left to resume
    return model


OPTIMIZERS = ("adamw", "muon")


def optimizer(params, device: torch.device, name: str = "adamw", head=None, **kwargs):
    """AdamW over float32 master weights; the fused CUDA kernel on a GPU (one launch instead of one per tensor).
    name="muon": torch.optim.Muon on the matrices other than `head` (the lm_head), at AdamW's update size per element
    (adjust_lr_fn="match_rms_adamw", so train.lr means the same), AdamW on the rest (norms, lm_head)."""
    if name == "adamw":
        return torch.optim.AdamW(params, fused=device.type == "cuda", **kwargs)
    if name != "muon":
        raise ValueError(f"config key train.optimizer: {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"config key train.optimizer: muon needs torch.optim.Muon, which torch {torch.__version__} "
                         "lacks; upgrade torch or set train.optimizer: adamw")
    params = list(params)
    matrices = [p for p in params if p.ndim == 2 and p is not head]
    rest = [p for p in params if not (p.ndim == 2 and p is not head)]
    return Optimizers([torch.optim.Muon(matrices, adjust_lr_fn="match_rms_adamw", **kwargs),
                       torch.optim.AdamW(rest, fused=device.type == "cuda", **kwargs)])


class Optimizers:
    """Several optimizers over disjoint parameters, stepped as one (the training loop's view of an optimizer)."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def state_dict(self) -> dict:
        return {str(i): o.state_dict() for i, o in enumerate(self.parts)}

    def load_state_dict(self, state: dict) -> None:
        for i, o in enumerate(self.parts):
            o.load_state_dict(state[str(i)])


@torch.no_grad()
def held_back_tau(model: Eagle3Draft, shard_paths: list[str], held: list[list[int]], embed: torch.Tensor,
                  max_tokens: int, device) -> float:
    """Offline tau at k = 3, greedy (eaglepipe.evaluate), of the model on the held-back train sequences."""
    from .evaluate import accepted_lengths, summarise, survival

    was_training = model.training
    model.eval()
    lengths = []
    with model.eager_steps():
        for path, seqs in zip(shard_paths, held, strict=True):
            if seqs:
                shard, _ = read_sequences(path, seqs, max_tokens)
                none_flagged = torch.zeros(shard["input_ids"].numel(), dtype=torch.bool)
                lengths.append(accepted_lengths(model, shard, embed, 3, max_tokens, str(device),
                                                none_flagged).lengths)
    model.train(was_training)
    return summarise(survival(torch.cat(lengths), 3))["tau"]["3"]


def autocast(device: torch.device, precision: str):
    """The arithmetic of a training step: float32 as written, or bfloat16 matrix products (weights stay float32)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def all_sum(t: torch.Tensor, device) -> torch.Tensor:
    """Sum of `t` over the ranks (t itself on one process); through `device`, since NCCL reduces only GPU tensors."""
    if not dist.is_initialized():
        return t
    t = t.to(device)
    dist.all_reduce(t)
    return t.cpu()


def save_progress(folder: Path, key: str, model, opt, **position) -> None:
    """One checkpoint unit, replaced atomically: weights, optimizer, RNG and the position in the schedule (the
    learning-rate schedule is a function of the step)."""
    unit = {"resume_key": key, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(), **position}
    with atomic_path(folder / "checkpoint.pt") as tmp:
        torch.save(unit, tmp)
    log.info("checkpoint at step %d written to %s", position["step"], folder / "checkpoint.pt")


def load_progress(folder: Path, key: str, model, opt) -> dict | None:
    path = folder / "checkpoint.pt"
    if not path.is_file():
        return None
    try:
        unit = torch.load(path, weights_only=True)
    except FileNotFoundError:  # another rank discarded a stale checkpoint meanwhile
        return None
    if unit["resume_key"] != key:
        log.info("discarding %s: it was made with other inputs or settings", path)
        path.unlink(missing_ok=True)  # every rank may get here
        return None
    model.load_state_dict(unit["model"])
    opt.load_state_dict(unit["optimizer"])
    torch.set_rng_state(unit["rng"])
    return unit


def processes(settings: dict) -> int:
    """Training processes: one per GPU when the job declares GPUs, else train.processes (CPU, gloo)."""
    return settings["gpus"] if settings["gpus"] > 0 else settings["processes"]


def launch(kwargs: dict, nprocs: int) -> None:
    """Run training in this process, or under torchrun with nprocs processes on this node (output goes to this
    process's stderr, the rule's log)."""
    if nprocs <= 1:
        run(**kwargs)
        return
    kwargs = {**kwargs, "threads": max(1, kwargs["threads"] // nprocs)}
    args_path = Path(kwargs.get("progress_dir") or Path(kwargs["out_dir"]) / ".progress") / "torchrun-args.json"
    with atomic_path(args_path) as tmp:
        tmp.write_text(json.dumps(kwargs, default=str))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
           "-m", "eaglepipe.train", str(args_path)]
    log.info("launching %s", " ".join(cmd))
    result = subprocess.run(cmd)
    args_path.unlink(missing_ok=True)
    if result.returncode != 0:
        raise RuntimeError(f"torchrun with {nprocs} processes failed (exit {result.returncode}); the ranks' errors "
                           "are above in this log")


def _die_with_parent() -> None:
    """torchrun starts ranks in sessions of their own: without this a killed job would leave them training."""
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def main(argv=None) -> None:
    """Entry point of one torchrun rank: `python -m eaglepipe.train ARGS.json`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("args", help="JSON file with the keyword arguments of eaglepipe.train.run")
    kwargs = json.loads(Path(parser.parse_args(argv).args).read_text())
    if sys.platform == "linux":
        _die_with_parent()
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    backend = "nccl" if kwargs["settings"]["device"].startswith("cuda") else "gloo"
    dist.init_process_group(backend)
    try:
        run(**kwargs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
