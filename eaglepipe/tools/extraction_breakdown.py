"""Where the extraction time goes: the same sequences through the forward alone, then to shards, per setting.

    python -m eaglepipe.tools.extraction_breakdown --preset llama-8b --device cuda --tokens 250000 \
        --out /root/bench-out --json breakdown.json

One model, loaded once (bench_extraction's presets or --target); for each (max_batch_tokens, chunk_size) setting:
- forward: engine.capture_rows consumed and released at once (device work and the host copies, no disk), tok/s;
- shards: bench_extraction.run_path's streaming path (the stage's code) to --out, fdatasync'd, tok/s;
- with --memory-out (a tmpfs such as /dev/shm, if large enough): the same shards into memory, so disk is out of it.
The machine's matmul peak and disk write rate are measured in the same run (limits.py), as bench_extraction does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from ..formats import bytes_per_token as shard_bytes_per_token
from .bench_extraction import draw_lengths, engine_on, forward_tok_s, load_model, matmul_params, run_path
from .limits import commit, describe, disk_write_gb_s, matmul_peak_tflops


def settings_of(text: str) -> list[tuple[int, int]]:
    """'32768:256,65536:2048' -> [(32768, 256), (65536, 2048)]: max_batch_tokens:chunk_size pairs."""
    try:
        return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--settings {text!r}: give max_batch_tokens:chunk_size pairs, "
                         "e.g. 32768:256,65536:2048") from None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--preset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--shard-tokens", type=int, default=250_000)
    parser.add_argument("--settings", default="32768:256,65536:256,65536:2048")
    parser.add_argument("--out", default="/tmp/eaglepipe-breakdown")
    parser.add_argument("--memory-out", help="a tmpfs folder (e.g. /dev/shm/x): shards written there as well")
    parser.add_argument("--disk-probe-gb", type=float, default=4.0)
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if bool(args.target) == bool(args.preset):
        parser.error("give one of --target or --preset")
    settings = settings_of(args.settings)
    device = torch.device(args.device)
    model = load_model(args.target, args.preset, device,
                       {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype])
    config = model.config
    layer_ids = sorted({2, config.num_hidden_layers // 2, config.num_hidden_layers - 3})  # distinct on small models
    params = matmul_params(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
            for n in draw_lengths(args.tokens, args.seed)]
    tokens = sum(map(len, seqs))
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    peak = matmul_peak_tflops(device)
    disk = disk_write_gb_s(out, args.disk_probe_gb)
    bytes_per_token = shard_bytes_per_token("bfloat16", len(layer_ids), config.hidden_size)
    result = {"device": describe(device), "commit": commit(),
              "command": "python -m eaglepipe.tools.extraction_breakdown " + " ".join(argv or sys.argv[1:]),
              "target": args.preset or str(args.target), "tokens": tokens, "sequences": len(seqs),
              "matmul_peak_tflops": peak, "disk_write_gb_s": disk, "bytes_per_token": bytes_per_token,
              "compute_limit_tok_s": peak * 1e12 / (2 * params), "disk_limit_tok_s": disk * 1e9 / bytes_per_token,
              "runs": []}
    print(f"{result['target']}: {tokens:,} tokens, {len(seqs):,} sequences; limits: compute "
          f"{result['compute_limit_tok_s']:,.0f} tok/s, disk {disk:.2f} GB/s -> "
          f"{result['disk_limit_tok_s']:,.0f} tok/s", flush=True)
    for max_batch_tokens, chunk_size in settings:
        engine = engine_on(model, args.device, args.dtype, True, max_batch_tokens)
        engine.capture(seqs[:4], layer_ids)  # kernels warm
        run = {"max_batch_tokens": max_batch_tokens, "chunk_size": chunk_size,
               "forward_tok_s": forward_tok_s(engine, seqs, layer_ids)}
        run["forward_tflops"] = 2 * params * run["forward_tok_s"] / 1e12
        targets = [("shards_tok_s", out / "run")]
        if args.memory_out:
            targets.append(("memory_shards_tok_s", Path(args.memory_out)))
        for key, folder in targets:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            run[key] = tokens / run_path(engine, seqs, layer_ids, folder, args.shard_tokens, chunk_size,
                                         streaming=True)
            shutil.rmtree(folder, ignore_errors=True)
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
