"""Generation speed of the transformers engine: its fast path against `model.generate` (the naive baseline).

    python -m eaglepipe.tools.bench_generation --target resources/targets/smollm2-135m --device cuda --dtype bfloat16 \
        --max-new-tokens 256 --json docs/measured/gpu-generation.json

The shipped prompts (eaglepipe/data/prompts.jsonl), rendered in the target's chat template, greedy. The fast path
generates for all of them; the baseline (`engine.fast_path: false`, today's `model.generate` path) for the first
--baseline-prompts of them, so its rate is measured on the same prompts. Prints generated tokens per second of each, the
ratio, achieved TFLOP/s (2 x parameters per generated token, attention over the cache left out) against the bf16 matmul
peak measured in the same run, and how many greedy sequences equal the baseline's token for token (in bf16 a different
batch composition can round differently; the first differing position is reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..chat import load_tokenizer, render_chat
from ..engines import open_engine
from ..engines.base import EngineSettings, Sampling
from ..prompts import default_source
from .limits import commit, describe, matmul_peak_tflops, sync


def timed_generate(target, settings: EngineSettings, prompts, sampling):
    with open_engine(target, settings) as eng:
        eng.generate(prompts[:2], Sampling(max_new_tokens=4))  # warm: kernels loaded before the clock starts
        params = sum(p.numel() for p in eng.model.parameters())
        sync(eng.device)
        start = time.perf_counter()
        gens = eng.generate(prompts, sampling)
        sync(eng.device)
        elapsed = time.perf_counter() - start
    return gens, elapsed, params


@torch.inference_mode()
def unpadded_first_tokens(target, settings: EngineSettings, prompts) -> list[int]:
    """The greedy first token of each prompt alone, unpadded: the arbiter when the two paths' batches disagree."""
    with open_engine(target, settings) as eng:
        return [int(eng.model(torch.tensor([p], device=eng.device)).logits[0, -1].argmax()) for p in prompts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=0, help="0: every shipped prompt")
    parser.add_argument("--repeat", type=int, default=1, help="use the prompt set this many times (more rows)")
    parser.add_argument("--baseline-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--baseline-batch-size", type=int, default=256)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.target)
    rows = [json.loads(line) for line in open(default_source())]
    prompts = [render_chat(tokenizer, r["messages"]) for r in rows][: args.prompts or None] * args.repeat
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    common = dict(name="transformers", device=args.device, dtype=args.dtype, threads=0, max_batch_tokens=1 << 18)
    peak = matmul_peak_tflops(device)
    fast, fast_s, params = timed_generate(args.target, EngineSettings(**common, batch_size=args.batch_size,
                                                                      fast_path=True), prompts, sampling)
    base_prompts = prompts[: args.baseline_prompts]
    base, base_s, _ = timed_generate(args.target, EngineSettings(**common, batch_size=args.baseline_batch_size,
                                                                 fast_path=False), base_prompts, sampling)
    arbiter = unpadded_first_tokens(args.target, EngineSettings(**common, fast_path=False), prompts[:64])
    first = {name: sum(bool(g.output_ids) and g.output_ids[0] == a for g, a in zip(gens, arbiter)) / len(arbiter)
             for name, gens in (("fast", fast), ("naive", base))}
    fast_tok = sum(len(g.output_ids) for g in fast)
    base_tok = sum(len(g.output_ids) for g in base)
    same = [first_difference(f.output_ids, b.output_ids) for f, b in zip(fast, base)]
    equal = sum(d is None for d in same)
    result = {
        "device": describe(device),
        "command": "python -m eaglepipe.tools.bench_generation " + " ".join(argv or sys.argv[1:]),
        "commit": commit(), "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "generated_tokens": fast_tok, "generated_tok_s": fast_tok / fast_s,
        "naive_tok_s": base_tok / base_s, "ratio_to_naive": (fast_tok / fast_s) / (base_tok / base_s),
        "achieved_tflops": 2 * params * fast_tok / fast_s / 1e12, "matmul_peak_tflops": peak,
        "greedy_equal_sequences": equal, "compared_sequences": len(base),
        "first_difference_positions": sorted(d for d in same if d is not None)[:20],
        "first_token_equal_unpadded": first,
        "finished_share": sum(g.finish_reason == "stop" for g in fast) / max(len(fast), 1),
    }
    result["mfu"] = result["achieved_tflops"] / peak
    print(f"fast path: {fast_tok} tokens in {fast_s:.1f} s = {result['generated_tok_s']:,.0f} tok/s "
          f"({result['achieved_tflops']:.1f} TFLOP/s, {100 * result['mfu']:.1f} % of the measured "
          f"{peak:.0f} TFLOP/s)")
    print(f"baseline (model.generate): {base_tok} tokens in {base_s:.1f} s = {result['naive_tok_s']:,.0f} tok/s; "
          f"ratio {result['ratio_to_naive']:.1f}x")
    print(f"greedy ids equal to the baseline's: {equal} of {len(base)} sequences; first differences at "
          f"{result['first_difference_positions']}")
    print(f"first token equal to the unpadded forward's argmax (first {len(arbiter)} prompts): fast "
          f"{first['fast']:.2f}, model.generate {first['naive']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
