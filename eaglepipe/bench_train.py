"""Draft training speed in float32 and in bf16 autocast (`train.precision`), measured in one run.

    python -m eaglepipe.bench_train --preset kimi-k2 --device cuda --tokens 4096 --ttt-steps 7

A draft of the preset target's shape (or of `--target-config config.json`) takes training steps on one packed batch of
random hidden states, through the training loop's own objective, batch layout, gradient clipping and AdamW; embeddings and target head
are random too, so no checkpoint is needed. Prints, per precision, ms per step, tokens per second and peak device
memory, then the bf16 / fp32 speed ratio. Both start from the same weights and batch, so their first-step losses must
agree closely; a large gap means the bf16 path computes something else.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .batches import collate, step_mask, targets
from .draft import DraftConfig
from .train import Objective, autocast, init_draft

# Shapes of targets this pipeline is built for (config.json keys the draft reads).
PRESETS = {
    # Kimi-K2 / K2.5 (DeepSeek-V3 architecture, 61 layers): hidden 7168, 64 heads, its published yarn rope.
    "kimi-k2": {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
                "num_key_value_heads": 64, "vocab_size": 163840, "max_position_embeddings": 131072,
                "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                        "original_max_position_embeddings": 4096}},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 2048, "max_position_embeddings": 2048, "rope_theta": 10000.0},
}


def synthetic_batch(config: DraftConfig, tokens: int, seq_len: int, device: torch.device, seed: int):
    """One packed batch of tokens // seq_len sequences: random token ids from the draft vocabulary, random states."""
    gen = torch.Generator().manual_seed(seed)
    n = max(tokens // seq_len, 1)
    t, h = n * seq_len, config.target_hidden_size
    shard = {
        "input_ids": torch.randint(config.draft_vocab_size, (t,), generator=gen),
        "loss_mask": torch.ones(t, dtype=torch.bool),
        "aux": torch.randn(t, len(config.aux_layer_ids), h, generator=gen),
        "final": torch.randn(t, h, generator=gen),
        "cu_seqlens": torch.arange(0, t + 1, seq_len),
    }
    return collate(shard, list(range(n)), seq_len, torch.float32, device)


def measure(config: DraftConfig, precision: str, device: torch.device, batch, ttt_steps: int, steps: int,
            seed: int) -> dict:
    """Warm-up step, then `steps` timed steps; the loss of the warm-up (first) step is returned too."""
    gen = torch.Generator().manual_seed(seed)
    vd, v, h = config.draft_vocab_size, config.vocab_size, config.hidden_size
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[:vd] = True  # the draft vocabulary is the first vd target ids: d2t offsets are 0
    vocab = {"d2t": torch.zeros(vd, dtype=torch.int64), "t2d": t2d}
    draft_head = torch.randn(vd, h, generator=gen) * 0.02
    model = init_draft(config, vocab, draft_head, seed).to(device)
    draft_head, t2d = draft_head.to(device), t2d.to(device)
    embed = (torch.randn(v, h, generator=gen) * 0.02).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    objective = Objective(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> float:
        with autocast(device, precision):
            probs, valid = targets(batch, draft_head, t2d)
            counts = [float(step_mask(batch, valid, j).sum()) for j in range(ttt_steps)]
            loss, _ = objective(batch, embed, probs, valid, counts, 0.8, 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)  # as train.run does every step
        opt.step()
        return float(loss.detach())

    first = step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del model, opt, objective, embed
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"precision": precision, "ms_per_step": 1000 * seconds, "tok_s": batch.tokens / seconds,
            "peak_gib": peak, "first_loss": first}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    parser.add_argument("--target-config", help="a target's config.json instead of a preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch (train.max_batch_tokens)")
    parser.add_argument("--seq-len", type=int, default=1024, help="length of each packed sequence")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per precision, after one warm-up step")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = json.load(open(args.target_config)) if args.target_config else PRESETS[args.preset]
    layers = target.get("num_hidden_layers", 8)
    config = DraftConfig.from_target(target, draft_vocab_size=min(args.draft_vocab, target["vocab_size"]),
                                     aux_layer_ids=[2, layers // 2, layers - 3])
    device = torch.device(args.device)
    batch = synthetic_batch(config, args.tokens, min(args.seq_len, args.tokens), device, args.seed)
    print(f"draft of {args.target_config or args.preset}: hidden {config.hidden_size}, heads "
          f"{config.num_attention_heads}x{config.head_dim}, intermediate {config.intermediate_size}, draft vocab "
          f"{config.draft_vocab_size}; batch {batch.tokens} tokens, {args.ttt_steps} unroll steps; {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    results = []
    for precision in ("fp32", "bf16"):
        r = measure(config, precision, device, batch, args.ttt_steps, args.steps, args.seed)
        results.append(r)
        print(f"{precision}: {r['ms_per_step']:.1f} ms/step, {r['tok_s']:.0f} tok/s, peak {r['peak_gib']:.1f} GiB, "
              f"first-step loss {r['first_loss']:.5f}")
    fp32, bf16 = results
    print(f"bf16 / fp32: {bf16['tok_s'] / fp32['tok_s']:.2f}x tokens per second; first-step losses differ by "
          f"{abs(bf16['first_loss'] - fp32['first_loss']) / abs(fp32['first_loss']):.2e} (relative)")
    return results


if __name__ == "__main__":
    main()
