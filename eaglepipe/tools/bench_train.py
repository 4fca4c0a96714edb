"""Draft training speed and memory on one device, against the naive path and the float32 reference, in one run.

    python -m eaglepipe.tools.bench_train --preset smollm2-135m,kimi-k2 --tokens 16384,4096 --seq-len 1024,2048 \
        --device cuda --json gpu-training.json

A draft of each preset target's shape (or of `--target-config config.json`) takes training steps on one packed batch
of random hidden states (sequences of --seq-len tokens), through the training loop's own objective, batch layout,
gradient clipping and AdamW; embeddings and target head are random too, so no checkpoint is needed. Per preset it
prints and writes (--json):
- the new path (train.py's: flex_attention context + merged diagonal, chunked soft cross-entropy) in bf16 autocast
  with float32 master weights: ms per step, tok/s, achieved TFLOP/s, % of the bf16 matmul peak measured in this run
  (MFU), peak device memory and peak bytes per token;
- its first-step loss against the float32 reference path (the original dense attention and per-step loss, a forward
  pass from the same weights and batch): relative gap within LOSS_TOLERANCE;
- the naive baseline (the original path in bf16, as training ran before: --no-baseline skips it; out of memory is
  reported, not fatal): tok/s, peak memory, the speed ratio, and how far its first-step gradient is from the new
  path's (relative L2 norm of the difference);
- both bf16 gradients against the float32 reference path's first-step gradient (the same weights and batch, no
  autocast): two bf16 computations round independently, so they can be farther from each other than either is from
  float32. The new path's gradient passes when it is no farther from float32 than the naive bf16 path's is (within
  GRAD_FP32_SLACK), or within GRAD_TOLERANCE of the naive one;
- start-up seconds of each path (building the draft and optimizer, then the first step; the first path measured also
  pays one-time costs such as compiling flex_attention on CUDA);
- with --compile, the new path again with its loss compiled (train.compile), measured right after the eager one:
  tok/s, the ratio, start-up seconds and its first-step loss gap; with --profile N, the N operators with the most
  self time in a step (device time on CUDA);
- with --anchor, speculators' own training step (eaglepipe.tools.anchor_step: speculators 0.9.0, installed
  separately) for the same draft shape and batch size, in the same process after ours: its start-up seconds, tok/s
  and peak memory, and speculators_ratio, our fastest path's tok/s over its.

FLOP per token (flop_per_token, written out in `flops`): with T tokens, R_j loss rows at unroll step j, V rows with a
target, pairs_j the (query, key) pairs attended at step j (document-causal context plus j diagonal entries):
    6 * P_layer * steps                     decoder layer (q, k, v, o, gate, up, down): forward 2, backward 4
  + 4 * P_fc                                fc once (its input needs no gradient: forward 2, weight gradient 2)
  + 6 * P_head * sum_j R_j / T              lm_head on the loss rows only
  + 2 * P_targethead * V / T                the soft targets (forward only)
  + 12 * heads * head_dim * sum_j pairs_j / T   attention: QK^T and PV forward 4, backward 8 per pair and dim
Elementwise work and anything recomputed are not counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from ..batches import collate, targets
from ..draft import DraftConfig
from ..train import Objective, autocast, init_draft, optimizer
from .limits import matmul_peak_tflops

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
LOSS_TOLERANCE = 1e-2  # relative gap of the bf16 first-step loss to the float32 reference's
GRAD_TOLERANCE = 5e-2  # relative L2 gap of the new path's first-step gradient to the baseline's (both bf16)
GRAD_FP32_SLACK = 1.25  # the new path's gap to the float32 gradient may exceed the naive bf16 path's by this factor


def synthetic_batch(config: DraftConfig, tokens: int, seq_len: int, device: torch.device, seed: int, steps: int):
    """One packed batch of tokens // seq_len sequences: random token ids from the draft vocabulary, random states;
    collated as train.py does (loss rows on the host)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(tokens // seq_len, 1)
    t, h = n * seq_len, config.target_hidden_size
    shard = {
        "input_ids": torch.randint(config.draft_vocab_size, (t,), generator=gen),
        "loss_mask": torch.ones(t, dtype=torch.bool),
        "aux": torch.randn(t, len(config.aux_layer_ids), h, generator=gen).to(torch.bfloat16),
        "final": torch.randn(t, h, generator=gen).to(torch.bfloat16),
        "cu_seqlens": torch.arange(0, t + 1, seq_len),
    }
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[:config.draft_vocab_size] = True  # the draft vocabulary is the first vd target ids: d2t offsets are 0
    return collate(shard, list(range(n)), seq_len, torch.float32, device, t2d=t2d, steps=steps), t2d


def flops(config: DraftConfig, batch, steps: int) -> dict:
    """The FLOP count of one training step, by term (see the module docstring), and per token."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = 2 * h * heads * d + 2 * (2 * h * kv * d) + heads * d * h + 3 * h * config.intermediate_size
    fc = len(config.aux_layer_ids) * config.target_hidden_size * h
    head = config.draft_vocab_size * h
    t = batch.tokens
    lengths = torch.bincount(batch.doc.cpu()).tolist()
    context_pairs = sum(n * (n + 1) // 2 for n in lengths)
    pairs = steps * context_pairs + t * steps * (steps - 1) // 2
    terms = {
        "layer": 6 * layer * steps * t,
        "fc": 4 * fc * t,
        "lm_head": 6 * head * sum(batch.step_counts),
        "targets": 2 * config.draft_vocab_size * config.target_hidden_size * int(batch.valid.sum()),
        "attention": 12 * heads * d * pairs,
    }
    return {"params_layer": layer, "params_fc": fc, "params_head": head, "terms": terms,
            "per_token": sum(terms.values()) / t}


def build(config, device, seed, attention):
    gen = torch.Generator().manual_seed(seed)
    vd, v, h = config.draft_vocab_size, config.vocab_size, config.hidden_size
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[:vd] = True
    vocab = {"d2t": torch.zeros(vd, dtype=torch.int64), "t2d": t2d}
    draft_head = torch.randn(vd, h, generator=gen) * 0.02
    model = init_draft(config, vocab, draft_head, seed).to(device)
    model.attention = attention
    embed = (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16).to(device)  # as train.py keeps it
    return model, draft_head.to(device), t2d.to(device), embed


def stepper(config: DraftConfig, device: torch.device, batch, seed: int, *, precision: str = "bf16",
            attention: str = "merged", loss: str = "chunked", compile: bool = False):
    """One path's training step from fresh weights, as train.run takes it (targets, objective, clipping, AdamW):
    step(keep_grad=False) -> (the loss, the gradient before clipping when keep_grad, else None). The closure holds the
    draft and its optimizer: drop it to free them."""
    model, draft_head, t2d, embed = build(config, device, seed, attention)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, device, lr=1e-4)
    objective = Objective(model, path=loss, compile="inductor" if compile else None)
    counts = [float(c) for c in batch.step_counts]

    def step(keep_grad: bool = False):
        opt.zero_grad(set_to_none=True)
        with autocast(device, precision):
            probs, valid = targets(batch, draft_head, t2d)
            value, _ = objective(batch, embed, probs, valid, counts, 0.8, 1.0)
        value.backward()
        grad = torch.cat([p.grad.detach().flatten().float().cpu() for p in params]) if keep_grad else None
        torch.nn.utils.clip_grad_norm_(params, 0.5)  # as train.run does every step
        opt.step()
        return value.detach(), grad
    return step


def measure(config: DraftConfig, device: torch.device, batch, ttt_steps: int, steps: int, seed: int, *,
            precision: str = "bf16", attention: str = "merged", loss: str = "chunked", keep_grad: bool = False,
            compile: bool = False) -> dict:
    """One path of ours, timed (timed()): the loss (and optionally the gradient) of its first step too."""
    result = timed(lambda: stepper(config, device, batch, seed, precision=precision, attention=attention, loss=loss,
                                   compile=compile), device, batch.tokens, steps, keep_grad)
    return {"precision": precision, "attention": attention, "loss": loss, "compile": compile, **result}


def timed(make, device: torch.device, tokens: int, steps: int, keep_grad: bool = False) -> dict:
    """Warm-up step, then `steps` timed steps of the training step make() builds (step(keep_grad) -> (loss, gradient
    or None)); the start-up seconds: building the draft and its optimizer and the first step (compiling, where it
    compiles)."""
    sync(device)
    begin = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step = make()
    first, grad = step(keep_grad)
    first = float(first)
    sync(device)
    start = time.perf_counter()
    startup = start - begin
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    step = None  # frees the draft and its optimizer before the next measurement
    free(device)
    return {"startup_s": startup, "ms_per_step": 1000 * seconds, "tok_s": tokens / seconds,
            "peak_gib": peak / 2 ** 30, "peak_bytes_per_token": peak / tokens, "first_loss": first, "grad": grad}


def profile(config, device, batch, seed, top: int, compile: bool = False) -> list[dict]:
    """The operators of two training steps of the new path (after a warm-up step) by self time on the device (CPU time
    on a CPU), top first: name, calls and milliseconds per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as record

    step = stepper(config, device, batch, seed, compile=compile)
    step()
    sync(device)
    cuda = device.type == "cuda"
    with record(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(2):
            step()
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    step = None
    free(device)
    return [{"name": e.key, "calls": e.count // 2, "self_ms": getattr(e, key) / 1e3 / 2} for e in rows]


@torch.no_grad()
def reference_loss(config, device, batch, ttt_steps, seed) -> float:
    """First-step loss of the float32 reference path (original dense attention, per-step loss): a forward pass."""
    model, draft_head, t2d, embed = build(config, device, seed, "dense")
    probs, valid = targets(batch, draft_head, t2d)
    value, _ = Objective(model, path="reference")(batch, embed, probs, valid, [float(c) for c in batch.step_counts],
                                                  0.8, 1.0)
    value = float(value)
    del model, embed, probs
    free(device)
    return value


def reference_grad(config, device, batch, ttt_steps, seed) -> torch.Tensor:
    """First-step gradient (before clipping) of the float32 reference path: dense attention, per-step loss, no
    autocast, from the same weights and batch as measure()'s first step."""
    model, draft_head, t2d, embed = build(config, device, seed, "dense")
    params = [p for p in model.parameters() if p.requires_grad]
    probs, valid = targets(batch, draft_head, t2d)
    value, _ = Objective(model, path="reference")(batch, embed, probs, valid, [float(c) for c in batch.step_counts],
                                                  0.8, 1.0)
    value.backward()
    grad = torch.cat([p.grad.detach().flatten().float().cpu() for p in params])
    del model, embed, probs, params, value
    free(device)
    return grad


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in the L2 norm."""
    return float((a - b).norm() / b.norm())


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def listed(value: str, n: int, kind=int) -> list:
    items = [kind(v) for v in str(value).split(",")]
    if len(items) == 1:
        items *= n
    if len(items) != n:
        raise SystemExit(f"{value!r}: give one value or one per preset ({n})")
    return items


def run_preset(name, target, tokens, seq_len, args, device, peak_tflops) -> dict:
    layers = target.get("num_hidden_layers", 8)
    config = DraftConfig.from_target(target, draft_vocab_size=min(args.draft_vocab, target["vocab_size"]),
                                     aux_layer_ids=[2, layers // 2, layers - 3])
    batch, _ = synthetic_batch(config, tokens, min(seq_len, tokens), device, args.seed, args.ttt_steps)
    count = flops(config, batch, args.ttt_steps)
    print(f"[{name}] draft: hidden {config.hidden_size}, heads {config.num_attention_heads}x{config.head_dim} "
          f"(kv {config.num_key_value_heads}), intermediate {config.intermediate_size}, draft vocab "
          f"{config.draft_vocab_size}; batch {batch.tokens} tokens in sequences of {min(seq_len, tokens)}, "
          f"{args.ttt_steps} unroll steps", flush=True)
    print(f"[{name}] FLOP/token {count['per_token'] / 1e9:.2f} G = " + " + ".join(
        f"{k} {v / batch.tokens / 1e9:.2f}" for k, v in count["terms"].items()) + " (G)", flush=True)
    new = measure(config, device, batch, args.ttt_steps, args.steps, args.seed, keep_grad=not args.no_baseline)
    achieved = count["per_token"] * new["tok_s"] / 1e12
    mfu = achieved / peak_tflops if peak_tflops else float("nan")
    try:
        ref = reference_loss(config, device, batch, args.ttt_steps, args.seed)
    except torch.OutOfMemoryError as e:  # dense [T, T] scores: a long packed row does not fit
        free(device)
        ref = None
        print(f"[{name}] float32 reference loss: out of memory ({str(e).splitlines()[0]})", flush=True)
    gap = abs(new["first_loss"] - ref) / abs(ref) if ref is not None else None
    print(f"[{name}] new path (bf16, flex attention + merged diagonal, chunked soft CE): "
          f"{new['ms_per_step']:.1f} ms/step, {new['tok_s']:.0f} tok/s, {achieved:.1f} TFLOP/s = "
          f"{100 * mfu:.1f} % of the measured {peak_tflops:.0f} TFLOP/s peak; peak {new['peak_gib']:.2f} GiB = "
          f"{new['peak_bytes_per_token'] / 1e3:.1f} kB/token", flush=True)
    if ref is not None:
        print(f"[{name}] first-step loss {new['first_loss']:.6f} vs float32 reference {ref:.6f}: relative gap "
              f"{gap:.2e} ({'within' if gap <= LOSS_TOLERANCE else 'OUTSIDE'} {LOSS_TOLERANCE:g})", flush=True)
    result = {
        "preset": name, "tokens": batch.tokens, "seq_len": min(seq_len, tokens), "ttt_steps": args.ttt_steps,
        "draft_vocab": config.draft_vocab_size, "flop_per_token": count["per_token"], "flop_terms": count["terms"],
        "tok_s": new["tok_s"], "ms_per_step": new["ms_per_step"], "tflop_s": achieved, "mfu": mfu,
        "peak_gib": new["peak_gib"], "peak_bytes_per_token": new["peak_bytes_per_token"],
        "loss_new": new["first_loss"], "loss_reference": ref, "loss_relative_gap": gap,
        "loss_tolerance": LOSS_TOLERANCE, "loss_ok": gap <= LOSS_TOLERANCE if ref is not None else None,
        "baseline_tok_s": None, "baseline_peak_gib": None, "speedup": None, "startup_s": new["startup_s"],
    }
    if args.compile:
        fused = measure(config, device, batch, args.ttt_steps, args.steps, args.seed, compile=True)
        # against the float32 reference where it fits, else against the eager bf16 path's first step
        base_loss = ref if ref is not None else new["first_loss"]
        fused_gap = abs(fused["first_loss"] - base_loss) / abs(base_loss)
        result["compiled"] = {
            "tok_s": fused["tok_s"], "ms_per_step": fused["ms_per_step"], "startup_s": fused["startup_s"],
            "mfu": count["per_token"] * fused["tok_s"] / 1e12 / peak_tflops if peak_tflops else float("nan"),
            "peak_gib": fused["peak_gib"], "loss": fused["first_loss"], "loss_relative_gap": fused_gap,
            "loss_gap_to": "float32 reference" if ref is not None else "eager bf16 path",
            "loss_ok": fused_gap <= LOSS_TOLERANCE, "speedup_over_eager": fused["tok_s"] / new["tok_s"],
        }
        print(f"[{name}] new path with the compiled loss (train.compile): {fused['ms_per_step']:.1f} ms/step, "
              f"{fused['tok_s']:.0f} tok/s = {result['compiled']['speedup_over_eager']:.2f}x eager (measured just "
              f"before), {100 * result['compiled']['mfu']:.1f} % of peak; start-up {fused['startup_s']:.1f} s "
              f"against {new['startup_s']:.1f} s eager; first-step loss gap to the "
              f"{result['compiled']['loss_gap_to']} {fused_gap:.2e}", flush=True)
    if args.anchor:
        from . import anchor_step

        theirs = timed(lambda: anchor_step.stepper(config, device, batch.tokens, min(seq_len, tokens), args.ttt_steps,
                                                   args.seed), device, batch.tokens, args.steps)
        ours = max(new["tok_s"], result.get("compiled", {}).get("tok_s", 0.0))
        result["anchor"] = {"trainer": f"speculators {anchor_step.VERSION}",
                            **{k: theirs[k] for k in ("tok_s", "ms_per_step", "startup_s", "peak_gib")}}
        result["speculators_ratio"] = ours / theirs["tok_s"]
        print(f"[{name}] speculators {anchor_step.VERSION}'s training step, same shape and batch: "
              f"{theirs['ms_per_step']:.1f} ms/step, {theirs['tok_s']:.0f} tok/s, start-up "
              f"{theirs['startup_s']:.1f} s, peak {theirs['peak_gib']:.2f} GiB; ours / theirs "
              f"{result['speculators_ratio']:.2f}x", flush=True)
    if args.profile:
        result["profile"] = profile(config, device, batch, args.seed, args.profile, compile=args.compile)
        print(f"[{name}] where a step's time goes (top {args.profile} by self time):", flush=True)
        for row in result["profile"]:
            print(f"    {row['self_ms']:9.3f} ms  {row['calls']:5d} x  {row['name'][:90]}", flush=True)
    if args.no_baseline:
        print(f"[{name}] naive baseline skipped (--no-baseline)", flush=True)
        return result
    try:
        base = measure(config, device, batch, args.ttt_steps, args.steps, args.seed, attention="dense",
                       loss="reference", keep_grad=True)
    except torch.OutOfMemoryError as e:
        free(device)
        result["baseline_error"] = f"out of memory: {str(e).splitlines()[0]}"
        print(f"[{name}] naive baseline: out of memory ({result['baseline_error']})", flush=True)
        return result
    diff = relative_gap(new["grad"], base["grad"])
    result.update(baseline_tok_s=base["tok_s"], baseline_peak_gib=base["peak_gib"],
                  baseline_loss=base["first_loss"], speedup=new["tok_s"] / base["tok_s"],
                  peak_ratio=base["peak_gib"] / new["peak_gib"], grad_relative_gap=diff,
                  grad_tolerance=GRAD_TOLERANCE, grad_ok=diff <= GRAD_TOLERANCE)
    print(f"[{name}] naive baseline (bf16, dense attention, per-step full logits): {base['ms_per_step']:.1f} ms/step, "
          f"{base['tok_s']:.0f} tok/s, peak {base['peak_gib']:.2f} GiB; new / baseline: {result['speedup']:.2f}x "
          f"tok/s, {result['peak_ratio']:.2f}x less memory; first-step gradient relative gap {diff:.2e} "
          f"({'within' if diff <= GRAD_TOLERANCE else 'OUTSIDE'} {GRAD_TOLERANCE:g})", flush=True)
    try:
        fp32 = reference_grad(config, device, batch, args.ttt_steps, args.seed)
    except torch.OutOfMemoryError as e:
        free(device)
        result["grad_fp32_error"] = f"out of memory: {str(e).splitlines()[0]}"
        print(f"[{name}] float32 reference gradient: out of memory", flush=True)
        return result
    new_gap, naive_gap = relative_gap(new["grad"], fp32), relative_gap(base["grad"], fp32)
    ok = diff <= GRAD_TOLERANCE or new_gap <= GRAD_FP32_SLACK * naive_gap
    result.update(grad_gap_new_to_fp32=new_gap, grad_gap_naive_to_fp32=naive_gap, grad_fp32_slack=GRAD_FP32_SLACK,
                  grad_ok=ok)
    print(f"[{name}] first-step gradient against the float32 reference's: new path {new_gap:.2e}, naive bf16 path "
          f"{naive_gap:.2e} ({'pass' if ok else 'FAIL'}: the new path may be {GRAD_FP32_SLACK:g}x the naive one's)",
          flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m", help=f"comma-separated: {', '.join(sorted(PRESETS))}")
    parser.add_argument("--target-config", help="a target's config.json instead of a preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokens", default="4096", help="tokens per batch (train.max_batch_tokens), or one per preset")
    parser.add_argument("--seq-len", default="1024", help="length of each packed sequence, or one per preset")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per path, after one warm-up step")
    parser.add_argument("--no-baseline", action="store_true", help="skip the naive baseline (it needs far more memory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="also measure the new path with the compiled loss (train.compile) in the same run")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list the N operators taking the most self time in a step")
    parser.add_argument("--anchor", action="store_true",
                        help="also time speculators' training step at the same shape (pip install speculators==0.9.0)")
    args = parser.parse_args(argv)
    if args.anchor:  # a missing install ends the run before anything is measured, not after
        from . import anchor_step

        anchor_step.check()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [args.target_config] if args.target_config else args.preset.split(",")
    for name in names:
        if not args.target_config and name not in PRESETS:
            raise SystemExit(f"--preset {name!r}: expected one of {', '.join(sorted(PRESETS))}")
    tokens, seq_lens = listed(args.tokens, len(names)), listed(args.seq_len, len(names))
    device = torch.device(args.device)
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    peak = matmul_peak_tflops(device)
    print(f"device {where}, torch {torch.__version__}; bf16 matmul peak {peak:.1f} TFLOP/s (8192^3 on CUDA, mean of "
          "10 after warm-up)", flush=True)
    results = []
    for name, n, seq_len in zip(names, tokens, seq_lens):
        target = json.load(open(name)) if args.target_config else PRESETS[name]
        results.append(run_preset(name, target, n, seq_len, args, device, peak))
    main_result = next((r for r in results if r["preset"] == "kimi-k2"), results[-1])
    summary = {
        "device": where, "torch": torch.__version__,
        "command": "python -m eaglepipe.tools.bench_train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "matmul_peak_tflops": peak,
        **{k: main_result[k] for k in ("mfu", "flop_per_token", "tok_s", "peak_gib", "peak_bytes_per_token",
                                       "baseline_tok_s", "loss_new", "loss_reference", "startup_s")},
        "presets": {r["preset"]: r for r in results},
    }
    for r in results:
        if r["preset"] == "smollm2-135m":
            summary["smollm2_peak_gib"] = r["peak_gib"]
            summary["smollm2_tok_s"] = r["tok_s"]
            if "speculators_ratio" in r:
                summary["speculators_ratio"] = r["speculators_ratio"]
        if r["preset"] == "kimi-k2":
            summary["kimi_peak_gib"] = r["peak_gib"]
    if args.json:
        from ..formats import write_json

        write_json(args.json, summary)
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
