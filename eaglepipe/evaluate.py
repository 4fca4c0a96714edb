"""Evaluate stage: offline acceptance of the draft on the eval split.

Under greedy decoding, chain speculation accepts draft token j exactly when it equals the target's own greedy
continuation and every earlier draft token was accepted. Unrolling the draft on the stored greedy continuation
therefore reproduces the engine's acceptance without running the engine; one unrolled pass scores every start
position at once. acceptance.json: per_position[i] = share of drafts whose first i+1 tokens were all accepted;
tau[k] = expected tokens per target pass with k draft tokens = 1 + E[min(accepted, k)].
by_sequence: {conversation id: [number of start positions that accepted 0, 1, .., max_k draft tokens]}, so the tau of
any set of conversations (e.g. the prompts the bench serves, or one prompt source) follows without the shards
(`subset`).
outside_loops: positions, per_position and tau over the start positions whose first drafted token is not a repeat of
the loop its response ends in (traces.trailing_loop, the tokens trace stats count as looping_token_share), and
starts_in_loops, the share of starts that are: a target that loops makes those trivial to draft, so this is the
figure for text that does not repeat itself.
Two means, both named: tau (and per_position) is pooled over start positions, each a verify step (vLLM's and SGLang's
served figure: accepted tokens over verify steps); tau_request_mean is the unweighted mean over conversations of each
one's own tau (SpecForge's benchmark figure), over `requests` conversations.
by_position: [{"from", "to" (null: open), positions, per_position, tau}] per bucket of the absolute position of a
start's first drafted token in its conversation (POSITION_BUCKETS; the evaluator cuts a conversation at
evaluate.max_batch_tokens, so buckets past it stay empty); the buckets' tau - 1 weighted by their positions sum to the
overall tau - 1.
temperatures: {"T": {positions, per_position, tau, tau_request_mean, requests, by_position}}: the same figures as the
expected acceptance under vLLM's speculative sampling at temperature T (sampled_survival).
tau_walk: tau as greedy serving measures it on this text: verify steps walk each conversation from its first start, each
step jumping past the tokens it accepted (`walk`), so starts inside an accepted run are not steps; it differs from the
pooled tau where acceptance comes in runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import provenance
from .batches import collate, pack, shifted, step_inputs
from .draft import load_checkpoint
from .formats import common_dtype, read_hidden_shard, write_json
from .target import load_embeddings, load_lm_head

log = logging.getLogger(__name__)

POSITION_BUCKETS = (0, 512, 1024, 2048, 4096)  # starts of the position buckets; the last one is open-ended


@dataclass
class Starts:
    """Every scored start position: accepted draft tokens (0..max_k) at T = 0, the shard's sequence index, whether
    its first drafted token is flagged, the position of that token in its sequence, and per temperature T the
    chance [starts, max_k] that its first i+1 drafted tokens are all accepted (sampled_survival)."""
    lengths: torch.Tensor
    owners: torch.Tensor
    flagged: torch.Tensor
    positions: torch.Tensor
    sampled: dict[float, torch.Tensor]

    @classmethod
    def cat(cls, parts: list["Starts"], temperatures=(), max_k: int = 1) -> "Starts":
        if not parts:
            empty = torch.zeros(0, dtype=torch.int64)
            return cls(empty, empty, empty.bool(), empty, {t: torch.zeros(0, max_k, dtype=torch.float64)
                                                           for t in temperatures})
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("lengths", "owners", "flagged", "positions")),
                   {t: torch.cat([p.sampled[t] for p in parts]) for t in parts[0].sampled})


def loop_tokens(shard: dict) -> torch.Tensor:
    """bool per shard token: the tokens of each sequence's last response (its last loss-mask span) that repeat the
    loop the response ends in (traces.trailing_loop)."""
    from .traces import trailing_loop

    ids, mask = shard["input_ids"], shard["loss_mask"].bool()
    flags = torch.zeros(ids.numel(), dtype=torch.bool)
    cu = shard["cu_seqlens"].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        inside = mask[a:b].nonzero().squeeze(1)
        if inside.numel() == 0:
            continue
        end = a + int(inside[-1]) + 1
        outside = (~mask[a:end]).nonzero().squeeze(1)
        start = a + (int(outside[-1]) + 1 if outside.numel() else 0)
        _, repeated = trailing_loop(ids[start:end].tolist())
        flags[end - repeated: end] = True
    return flags


def sampled_survival(logits: torch.Tensor, rows: torch.Tensor, proposals: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """Chance that the first i+1 proposals are all accepted, [starts, max_k], under vLLM 0.32's speculative sampling
    at `temperature` with top-p 1. logits [T, V]: the target's logits at every token; rows [starts, max_k]: the token
    whose logits verify each proposal; proposals [starts, max_k]: the draft's tokens (target ids).

    vLLM 0.32 drafts greedily at any temperature: SpeculativeConfig.draft_sample_method defaults to "greedy" and
    SpecDecodeBaseProposer._sample_draft_tokens (v1/spec_decode/llm_base_proposer.py, under EagleProposer in
    v1/spec_decode/eagle.py) then takes the argmax of the draft's logits and passes no draft probabilities. Its
    rejection sampler (v1/sample/rejection_sampler.py: apply_sampling_constraints divides the target logits by the
    temperature; rejection_random_sample_kernel with NO_DRAFT_PROBS sets draft_prob = 1) accepts proposal j when a
    uniform u_j <= target_prob / 1, one independent u per proposal, and stops at the first rejection. So proposal j
    survives with the target's probability of it at T, p_j = softmax(logits_j / T)[d_j], and the first i+1 all
    survive with p_0 * .. * p_i. The target probabilities are those of the stored trace's context: exact while the
    draft's proposals follow the trace (always so at T = 0), read at the trace's context past a proposal that leaves it
    (the stored states hold no other)."""
    lse = torch.logsumexp(logits / temperature, -1)
    logp = logits[rows, proposals] / temperature - lse[rows]
    return logp.double().cumsum(-1).exp()


@torch.inference_mode()
def accepted_lengths(model, shard: dict, embed: torch.Tensor, max_k: int, max_tokens: int, device: str,
                     token_flags: torch.Tensor, head: torch.Tensor | None = None, temperatures=()) -> Starts:
    """The Starts of every start position whose continuation is generated (token_flags: bool per shard token);
    model, embed and head (the target's lm_head [V, H], needed with temperatures) on `device`."""
    parts = []
    cu = shard["cu_seqlens"].tolist()
    n = len(cu) - 1
    for seqs in pack(shard["cu_seqlens"], max_tokens, list(range(n))):
        batch = collate(shard, seqs, max_tokens, torch.float32, device)
        idx = torch.arange(batch.tokens, device=device)
        # Start t drafts x[t+2 .. t+1+max_k]: all inside the sequence, the first one generated by the target.
        starts = (idx + 2 + max_k <= batch.seq_end) & shifted(batch.loss_mask, 2, False)
        guesses = []
        for out in model.unroll(batch.aux, step_inputs(batch, max_k, embed), batch.positions, batch.packing):
            guesses.append(model.to_target_ids(model.lm_head(out[0]).argmax(-1)))
        truth = torch.stack([shifted(batch.input_ids, 2 + j, -1) for j in range(max_k)], 1)[starts]
        proposals = torch.stack(guesses, 1)[starts]  # [starts, max_k]
        sampled = {}
        if temperatures:
            # proposal j of start t is verified by the target's state at t+1+j (the one that predicts x[t+2+j])
            rows = starts.nonzero().squeeze(1)[:, None] + 1 + torch.arange(max_k, device=device)
            logits = batch.final @ head.T  # [T, V]
            sampled = {t: sampled_survival(logits, rows, proposals, t).cpu() for t in temperatures}
        # the batch's tokens in shard order, each sequence cut as collate cuts it
        index = torch.cat([torch.arange(cu[i], min(cu[i + 1], cu[i] + max_tokens)) for i in seqs])
        on_host = starts.cpu()
        parts.append(Starts(lengths=(proposals == truth).int().cumprod(1).sum(1).cpu(),
                            owners=torch.tensor(seqs)[batch.doc.cpu()[on_host]],
                            flagged=shifted(token_flags[index], 2, False)[on_host],
                            positions=batch.positions[0].cpu()[on_host] + 2, sampled=sampled))
    return Starts.cat(parts, temperatures, max_k)


def survival(lengths: torch.Tensor, max_k: int) -> torch.Tensor:
    """[starts, max_k]: 1.0 where the start's first i+1 drafted tokens were accepted (greedy scoring)."""
    return (lengths[:, None] > torch.arange(max_k)).double()


def summarise(survived: torch.Tensor) -> dict:
    """Figures pooled over start positions from survived [starts, max_k] (survival, sampled_survival)."""
    n, max_k = survived.shape
    mean = survived.sum(0) / max(n, 1)
    return {
        "positions": int(n),
        "per_position": [float(v) for v in mean],
        "tau": {str(k): 1.0 + float(mean[:k].sum()) for k in range(1, max_k + 1)},
    }


def figures(survived: torch.Tensor, owners: torch.Tensor, positions: torch.Tensor) -> dict:
    """summarise() pooled over start positions, the unweighted mean over conversations (owners: index of each
    start's conversation) of their own tau, and the pooled figures per position bucket."""
    max_k = survived.shape[1]
    requests = int(owners.max()) + 1 if owners.numel() else 0
    sums = torch.zeros(requests, max_k, dtype=torch.float64).index_add_(0, owners, survived.double())
    ones = torch.ones_like(owners, dtype=torch.float64)
    counts = torch.zeros(requests, dtype=torch.float64).index_add_(0, owners, ones)
    own = sums[counts > 0] / counts[counts > 0, None]  # per conversation: mean survival per draft position
    return {
        **summarise(survived),
        "tau_request_mean": {str(k): 1.0 + float(own[:, :k].sum(1).mean()) if own.numel() else 1.0
                             for k in range(1, max_k + 1)},
        "requests": int(own.shape[0]),
        "by_position": [{"from": a, "to": b, **summarise(survived[(positions >= a) & (positions < (b or 1 << 62))])}
                        for a, b in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:] + (None,))],
    }


def walk(lengths: torch.Tensor, owners: torch.Tensor, positions: torch.Tensor, max_k: int) -> dict[str, float]:
    """tau per k over the verify steps greedy serving takes: in each conversation from its first start, a step at
    start p accepts min(lengths[p], k) tokens and the next step is at p + accepted + 1, while that is a start."""
    at = {(int(o), int(p)): int(n) for o, p, n in zip(owners.tolist(), positions.tolist(), lengths.tolist())}
    firsts = {}
    for o, p in at:
        firsts[o] = min(p, firsts.get(o, p))
    tau = {}
    for k in range(1, max_k + 1):
        steps = accepted = 0
        for o, p in firsts.items():
            while (o, p) in at:
                n = min(at[(o, p)], k)
                steps, accepted, p = steps + 1, accepted + n, p + n + 1
        tau[str(k)] = 1.0 + accepted / max(steps, 1)
    return tau


def add_histograms(table: dict[str, list[int]], lengths: torch.Tensor, owners: torch.Tensor, ids: list[str],
                   max_k: int) -> None:
    """Add each sequence's counts of accepted lengths 0..max_k to table[id] (ids in shard order; an id met twice,
    e.g. turns of one conversation, sums)."""
    counts = torch.zeros(len(ids), max_k + 1, dtype=torch.int64)
    counts.index_put_((owners, lengths.long()), torch.ones_like(lengths, dtype=torch.int64), accumulate=True)
    for i, row in zip(ids, counts.tolist()):
        table[i] = [a + b for a, b in zip(table[i], row)] if i in table else row


def subset(acceptance: dict, ids) -> dict | None:
    """summarise()'s figures over the conversations `ids` from acceptance.json's by_sequence; None when the file has
    no by_sequence (written before it existed) or none of the ids is in it."""
    table = acceptance.get("by_sequence")
    rows = [table[i] for i in ids if table and i in table]
    if not rows:
        return None
    counts = torch.tensor(rows).sum(0)
    lengths = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return {"sequences": len(rows), **summarise(survival(lengths, int(acceptance["max_k"])))}


def score(model, shard_paths: list[str], embed: torch.Tensor, max_k: int, max_tokens: int, device: str = "cpu",
          head: torch.Tensor | None = None, temperatures=()) -> dict:
    """acceptance.json's content for these shards (head: the target's lm_head on `device`, for temperatures)."""
    parts, by_sequence, conversations, sequences, seen = [], {}, {}, [torch.zeros(0, dtype=torch.int64)], 0
    common_dtype(sorted(shard_paths))  # mixed bf16 and fp8 shards are refused, the odd shard named
    for path in sorted(shard_paths):
        shard, metadata = read_hidden_shard(path)
        found = accepted_lengths(model, shard, embed, max_k, max_tokens, device, loop_tokens(shard), head, temperatures)
        ids = metadata.get("ids") or [f"{path}#{i}" for i in range(shard["cu_seqlens"].numel() - 1)]
        add_histograms(by_sequence, found.lengths, found.owners, ids, max_k)
        sequences.append(found.owners + seen)  # one index per sequence across shards: the walk's unit
        seen += len(ids)
        # one index per conversation id across shards (turns of one conversation are one request)
        found.owners = torch.tensor([conversations.setdefault(i, len(conversations)) for i in ids],
                                    dtype=torch.int64)[found.owners]
        parts.append(found)
    found = Starts.cat(parts, temperatures, max_k)
    looped = found.flagged
    outside = {**summarise(survival(found.lengths[~looped], max_k)),
               "starts_in_loops": float(looped.sum()) / max(looped.numel(), 1)}
    return {"max_k": max_k, **figures(survival(found.lengths, max_k), found.owners, found.positions),
            "tau_walk": walk(found.lengths, torch.cat(sequences), found.positions, max_k),
            "by_sequence": by_sequence, "outside_loops": outside,
            "temperatures": {str(t): figures(found.sampled[t], found.owners, found.positions) for t in temperatures}}


def measure(shard_paths: list[str], draft_dir, *, target_dir, max_k: int, max_tokens: int, threads: int,
            device: str = "cpu", temperatures=(), manifest_path=None, remedy: str = provenance.RETRAIN) -> dict:
    """score() of the draft in draft_dir on these shards, loaded on `device` once its provenance matches the target
    and the manifest (the hidden states' layers) it is scored with."""
    provenance.check(draft_dir, target_dir=target_dir, manifest_path=manifest_path, remedy=remedy)
    torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("config key evaluate.device is 'cuda' but torch sees no CUDA device; "
                           "set evaluate.device: cpu")
    model = load_checkpoint(draft_dir).eval().to(device)
    embed = load_embeddings(target_dir).float().to(device)
    head = load_lm_head(target_dir).float().to(device) if temperatures else None
    return score(model, shard_paths, embed, max_k, max_tokens, device, head, list(temperatures))


def run(shard_paths: list[str], draft_dir, output_path, **settings) -> None:
    """measure() written to output_path (acceptance.json)."""
    result = measure(shard_paths, draft_dir, **settings)
    write_json(output_path, result)
    log.info("offline acceptance over %d positions: tau %s; outside trailing loops (%.1f %% of starts are in one): %s",
             result["positions"], {k: round(v, 3) for k, v in result["tau"].items()},
             100 * result["outside_loops"]["starts_in_loops"],
             {k: round(v, 3) for k, v in result["outside_loops"]["tau"].items()})
    for t, r in result["temperatures"].items():
        log.info("expected acceptance at temperature %s: tau %s", t, {k: round(v, 3) for k, v in r["tau"].items()})


def continuation_rows(ids: list[str], prompts: list[list[int]], generations) -> list[dict]:
    """Trace rows (formats.TRACE_SCHEMA) of the target's own continuations (engine Generations) of these prompts."""
    return [{"id": i, "split": "eval", "prompt_ids": list(p), "output_ids": list(g.output_ids),
             "loss_spans": [len(p), len(p) + len(g.output_ids)], "turns": 1, "finish_reason": g.finish_reason,
             "prompt_tokens": len(p), "output_tokens": len(g.output_ids), "error": g.error}
            for i, p, g in zip(ids, prompts, generations)]


def over_texts(rows: list[dict], draft_dirs: list, *, target_dir, layer_ids: list[int], engine: dict, max_k: int,
               max_length: int, threads: int) -> list[dict]:
    """score() of each draft over these trace rows' texts, on hidden states at `layer_ids` extracted once by `engine`
    into a temporary shard as the hidden_states stage does."""
    import tempfile
    from pathlib import Path

    from . import hidden_states
    from .formats import TRACE_SCHEMA, write_table

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="eaglepipe-offline-") as tmp:
        trace_path, shard_path = Path(tmp) / "traces.parquet", Path(tmp) / "shard.safetensors"
        write_table(trace_path, sorted(rows, key=lambda t: t["id"]), TRACE_SCHEMA)
        hidden_states.run(trace_path, shard_path, target_dir=target_dir, layer_ids=layer_ids, engine=engine,
                          max_length=max_length, chunk_size=max(len(rows), 1))
        embed = load_embeddings(target_dir).float()
        return [score(load_checkpoint(d).eval(), [str(shard_path)], embed, max_k, 4096) for d in draft_dirs]
