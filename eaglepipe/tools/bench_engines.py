"""Throughput of the two engines on the same work, measured in one run.

    python -m eaglepipe.tools.bench_engines --target resources/targets/smollm2-135m --prompts 64 --max-new-tokens 64

Generation: the shipped prompts, greedy, tokens generated per second. Capture: the prompts plus their generations
(the same sequences for both engines), tokens captured per second. Engine start is excluded and printed apart.
Prints one line per engine and stage, then the vLLM / transformers ratio of each stage.
"""

from __future__ import annotations

import argparse
import json
import time

from ..chat import load_tokenizer, render_chat
from ..engines import open_engine
from ..engines.base import EngineSettings, Sampling
from ..prompts import default_source
from ..target import read_info


def measure(target, settings: EngineSettings, prompts, sampling, layer_ids, sequences=None):
    results = {}
    started = time.monotonic()
    with open_engine(target, settings) as eng:
        eng.generate(prompts[:1], Sampling(max_new_tokens=2))  # the engine is up and warm before timing
        results["start_s"] = time.monotonic() - started
        t = time.monotonic()
        gens = eng.generate(prompts, sampling)
        results["generate_tok_s"] = sum(len(g.output_ids) for g in gens) / (time.monotonic() - t)
    sequences = sequences or [g.prompt_ids + g.output_ids for g in gens]
    with open_engine(target, settings) as eng:
        eng.capture(sequences[:1], layer_ids)
        t = time.monotonic()
        eng.capture(sequences, layer_ids)
        results["capture_tok_s"] = sum(map(len, sequences)) / (time.monotonic() - t)
    return results, sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    rows = [json.loads(line) for line in open(default_source())][: args.prompts]
    prompts = [render_chat(tokenizer, r["messages"]) for r in rows]
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    layer_ids = read_info(args.target).default_layer_ids()
    common = dict(device=args.device, dtype=args.dtype, threads=args.threads, batch_size=args.prompts)
    hf, sequences = measure(args.target, EngineSettings(name="transformers", **common), prompts, sampling, layer_ids)
    vl, _ = measure(args.target, EngineSettings(name="vllm", **common), prompts, sampling, layer_ids, sequences)
    for name, r in (("transformers", hf), ("vllm", vl)):
        print(f"{name:12s} start {r['start_s']:6.1f} s  generate {r['generate_tok_s']:8.1f} tok/s  "
              f"capture {r['capture_tok_s']:8.1f} tok/s")
    print(f"ratio vllm/transformers: generate {vl['generate_tok_s'] / hf['generate_tok_s']:.2f}x, "
          f"capture {vl['capture_tok_s'] / hf['capture_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
