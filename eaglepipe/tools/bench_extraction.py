"""Hidden-state extraction written to shards: the fast path against today's naive path, with the machine's limits.

    python -m eaglepipe.tools.bench_extraction --target resources/targets/smollm2-135m --device cuda --tokens 2000000 \
        --json docs/measured/gpu-extraction.json
    python -m eaglepipe.tools.bench_extraction --preset llama-8b --device cuda --tokens 400000 --json ...

Sequence lengths are drawn from a trace shard (--lengths-from results/traces/train/shard-0.parquet: prompt + output
tokens of each row) or, without one, from the embedded default's measured distribution (a fixed seeded draw), up to
--tokens in all; token ids are random. A preset target (`llama-8b`: Llama-3.1-8B's shape) has random weights, built on
the device from its config; --target loads a checkpoint.

Both paths capture the default aux layers (2, N//2, N-3: "input of layer k") and the final normed state, and write
shards of --shard-tokens tokens to --out (local disk): the fast path through engine.fast_path `true` and the stage's
own streaming code (hidden_states.extract: engine.capture_rows into a ring of pinned host buffers, rows written at
their offsets by shard_writer.StreamingShard while the next batch runs, chunk records of --chunk-size sequences for
resume); the naive path through `model(..., output_hidden_states=True)` on padded batches (`engine.fast_path: false`),
then one `save_file` per shard, as the stage did before. Prints tokens/s of each, their ratio, and the limits measured
in the same run: compute (bf16 matmul peak / 2 x the parameters a forward multiplies by: no embedding, no head) and
disk (sequential write rate / bytes per token); the fast path's share of each and of the lower one. Also the forward
alone (capture_rows with no writer, on the baseline's sequences; again without the fused q/k/v and gate/up products:
`forward_unfused_tok_s`, and with the elementwise steps eager where they compile: `forward_eager_tok_s`), the shard
writer alone (one shard of host rows, no GPU: `writer_tok_s`) and, before anything is timed, the packed kernel
against per-sequence attention on the first 8 sequences (`packed_check`: changing the first sequence must leave the
others' states as they are, else the run stops). With --fp8, the fast path runs again on the same sequences writing
fp8 shards (hidden_states.dtype float8_e4m3fn: quantized on the device before the copy to host), so bf16 and fp8
extraction rates and the shards' bytes per token come from one run: `extract_tok_s_bf16`, `extract_tok_s_fp8`,
`bytes_per_token_bf16`, `bytes_per_token_fp8` (bytes on disk over tokens, headers included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from ..engines.base import EngineSettings
from ..formats import bytes_per_token as shard_bytes_per_token
from ..formats import write_hidden_shard
from ..hidden_states import extract, shard_tensors
from ..shard_writer import HASH_THREADS, StreamingShard
from ..resume import Units
from .limits import commit, describe, disk_write_gb_s, matmul_peak_tflops, sha256_gb_s, sync

PRESETS = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def draw_lengths(total: int, seed: int, lengths_from=None) -> list[int]:
    """Sequence lengths summing to about `total`: resampled from a trace shard, else a seeded lognormal (median ~170,
    clipped to 16..2048, the embedded default's prompt + response range)."""
    gen = torch.Generator().manual_seed(seed)
    if lengths_from:
        import pyarrow.parquet as pq

        table = pq.read_table(lengths_from, columns=["prompt_tokens", "output_tokens"]).to_pydict()
        pool = torch.tensor([a + b for a, b in zip(table["prompt_tokens"], table["output_tokens"]) if b > 0])
    else:
        pool = torch.exp(torch.randn(4096, generator=gen) * 0.6 + 5.1).round().clamp(16, 2048).long()
    out, n = [], 0
    while n < total:
        length = int(pool[torch.randint(len(pool), (1,), generator=gen)])
        out.append(length)
        n += length
    return out


def load_model(target, preset, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if preset:
        config = LlamaConfig(**PRESETS[preset])
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()


def engine_on(model, device: str, dtype: str, fast: bool, max_batch_tokens: int):
    """A TransformersEngine around an already built model (presets have no checkpoint folder to load)."""
    from ..engines.transformers import TransformersEngine

    engine = TransformersEngine.__new__(TransformersEngine)
    engine.setup(model, None, EngineSettings(name="transformers", device=device, dtype=dtype, threads=0,
                                             batch_size=4096, max_batch_tokens=max_batch_tokens,
                                             fast_path=fast))
    return engine


def matmul_params(model) -> int:
    """Parameters a forward multiplies by: all but the input embedding (a lookup) and the output head (extraction
    computes no logits); a tied head is the embedding, counted once either way."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def forward_tok_s(engine, seqs, layer_ids) -> float:
    """capture_rows over all sequences, each batch released as soon as it is handed out: no writer, no disk."""
    sync(engine.device)
    start = time.perf_counter()
    for rows in engine.capture_rows(seqs, layer_ids):
        rows.release()
    sync(engine.device)
    return sum(map(len, seqs)) / (time.perf_counter() - start)


def writer_tok_s(out: Path, tokens: int, n_aux: int, hidden: int, batch_tokens: int) -> float:
    """StreamingShard alone: one shard of `tokens` rows fed in order, `batch_tokens` rows a batch, from two host
    buffers reused as the engine's ring reuses them (filled once, no GPU), closed (hash, fsync, rename) within the
    time: the host path's own rate, to set against the disk probe and the full path."""
    torch.manual_seed(0)
    ring = [(torch.empty(batch_tokens, n_aux, hidden, dtype=torch.bfloat16).normal_(),
             torch.empty(batch_tokens, hidden, dtype=torch.bfloat16).normal_()) for _ in range(2)]
    free = [threading.Semaphore(1) for _ in ring]
    small = shard_tensors([[0] * tokens], [[1] * tokens])
    start = time.perf_counter()
    with StreamingShard(out / "writer.safetensors", **small, n_aux=n_aux, hidden=hidden, metadata={}) as shard:
        for i, row in enumerate(range(0, tokens, batch_tokens)):
            n = min(batch_tokens, tokens - row)
            slot = i % len(ring)
            free[slot].acquire()
            shard.write_runs([(row, 0, n)], *ring[slot], release=free[slot].release)
        shard.close()
    seconds = time.perf_counter() - start
    (out / "writer.safetensors").unlink()
    return tokens / seconds


def shard_bytes(folder: Path) -> int:
    """Bytes of the shards in a folder."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def packed_check(engine, seqs, layer_ids) -> dict:
    """The packed capture's kernel (varlen flash on CUDA) on the first sequences, two ways:
    - isolation: the same batch with the first sequence's tokens changed (same length): every later sequence's states
      must not move (each row's matmuls and norms are its own, and attention must stay inside its sequence); so the
      relative change of their rows is 0, where attention reaching into another sequence gives order 1e-1 or more;
    - against one causal SDPA per sequence on the same packed batch: the relative error ||kernel - reference|| /
      ||reference|| of each aux layer and of the final states. Two bf16 kernels round differently and the difference
      grows with depth (a few % after 30 layers of random weights), so this is reported, not a pass mark."""
    dec = engine.fast
    lengths = [len(s) for s in seqs]
    vocab = engine.model.config.vocab_size
    changed = [[(t + 7) % vocab for t in reversed(seqs[0])]] + list(seqs[1:])

    def run(batch):
        return dec.hidden_states(torch.tensor([t for s in batch for t in s], device=engine.device), lengths, layer_ids)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()

    with torch.inference_mode():
        got = run(seqs)
        other = run(changed)
        dec.varlen = False
        try:
            ref = run(seqs)
        finally:
            dec.varlen = True
    rest = slice(lengths[0], None)
    call = dec.varlen_call()
    kernel = "per-sequence SDPA" if call is None else "varlen flash" + (", k/v repeated per group" if call[2] else "")
    return {"kernel": kernel, "sequences": len(seqs),
            "isolation_error": max(rel(other[0][rest], got[0][rest]), rel(other[1][rest], got[1][rest])),
            "aux_relative_error": rel(got[0], ref[0]), "final_relative_error": rel(got[1], ref[1]),
            "aux_layer_relative_errors": {str(k): rel(got[0][:, i], ref[0][:, i]) for i, k in enumerate(layer_ids)}}


def run_path(engine, seqs, layer_ids, out: Path, shard_tokens: int, chunk_size: int, streaming: bool,
             dtype: str = "bfloat16") -> float:
    """Capture every sequence and write shards (their states in `dtype`, streaming only); returns seconds, the last
    byte on disk (fsync) included. streaming: the stage's own code (hidden_states.extract: capture_rows into
    StreamingShard, chunk records in a progress folder as the stage keeps them); else the naive path (capture(),
    torch.cat, save_file, fsync)."""
    shards, current, n = [], [], 0
    for s in seqs:
        current.append(s)
        n += len(s)
        if n >= shard_tokens:
            shards.append(current)
            current, n = [], 0
    if current:
        shards.append(current)
    hidden = engine.model.config.hidden_size
    sync(engine.device)
    start = time.perf_counter()
    for number, shard in enumerate(shards):
        path = out / f"shard-{number}.safetensors"
        masks = [[1] * len(s) for s in shard]
        small = shard_tensors(shard, masks)
        meta = {"ids": [str(i) for i in range(len(shard))], "layer_ids": layer_ids}
        if streaming:
            units = Units(out / f".progress-{number}", "bench", f"bench shard {number}")
            extract(engine, path, shard, small, meta, layer_ids, hidden=hidden, chunk_size=chunk_size, units=units,
                    dtype=dtype)
            units.finish(-(-len(shard) // chunk_size))
        else:
            caps = engine.capture(shard, layer_ids)
            write_hidden_shard(path, {**small, "aux": torch.cat([c.aux for c in caps]),
                                      "final": torch.cat([c.final for c in caps])}, meta)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--baseline-tokens", type=int, default=0, help="0: the same sequences as the fast path")
    parser.add_argument("--lengths-from")
    parser.add_argument("--shard-tokens", type=int, default=1_000_000)
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="sequences per resume chunk (config hidden_states.chunk_size); 0: from --chunk-tokens")
    parser.add_argument("--chunk-tokens", type=int, default=131072,
                        help="without --chunk-size: chunks of about this many tokens (at the mean sequence length)")
    parser.add_argument("--disk-probe-gb", type=float, default=4.0, help="bytes written to measure the disk rate")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--baseline-batch-tokens", type=int, default=8192, help="padded tokens per naive batch")
    parser.add_argument("--out", default="/tmp/eaglepipe-bench-extraction")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--fp8", action="store_true",
                        help="also extract fp8 shards (hidden_states.dtype float8_e4m3fn) on the same sequences")
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if bool(args.target) == bool(args.preset):
        parser.error("give one of --target or --preset")
    device = torch.device(args.device)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    model = load_model(args.target, args.preset, device, dtypes[args.dtype])
    config = model.config
    layers = config.num_hidden_layers
    layer_ids = [2, layers // 2, layers - 3]
    params = matmul_params(model)
    lengths = draw_lengths(args.tokens, args.seed, args.lengths_from)
    gen = torch.Generator().manual_seed(args.seed + 1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    peak = matmul_peak_tflops(device)
    disk = disk_write_gb_s(out, args.disk_probe_gb)
    bytes_per_token = shard_bytes_per_token("bfloat16", len(layer_ids), config.hidden_size)
    compute_limit = peak * 1e12 / (2 * params)
    disk_limit = disk * 1e9 / bytes_per_token
    tokens = sum(lengths)
    chunk_size = args.chunk_size or max(1, round(args.chunk_tokens * len(lengths) / tokens))

    writer = writer_tok_s(out, min(args.shard_tokens, tokens), len(layer_ids), config.hidden_size,
                          args.max_batch_tokens)
    sha = sha256_gb_s()
    print(f"shard writer alone: {writer:,.0f} tok/s ({100 * writer / disk_limit:.0f} % of the disk limit); one sha256 "
          f"stream {sha:.2f} GB/s -> {sha * 1e9 / bytes_per_token:,.0f} tok/s (the writer hashes blocks on "
          f"{HASH_THREADS} threads)")
    fast = engine_on(model, args.device, args.dtype, True, args.max_batch_tokens)
    check = packed_check(fast, seqs[:8], layer_ids)  # fail fast: a kernel that mixes sequences shows here
    layers = ", ".join(f"{k}: {e:.1e}" for k, e in check["aux_layer_relative_errors"].items())
    print(f"packed capture ({check['kernel']}) on {check['sequences']} sequences: isolation error "
          f"{check['isolation_error']:.1e}; against per-sequence SDPA, relative error by aux layer {layers}, final "
          f"{check['final_relative_error']:.1e}")
    if check["isolation_error"] > 1e-2:
        raise SystemExit("packed capture: changing the first sequence moved the states of the others by "
                         f"{check['isolation_error']:.1e} (relative norm): the varlen kernel is not keeping sequences "
                         "apart; not benchmarking it")
    fast.capture(seqs[:4], layer_ids)  # warm (kernels; the host ring is allocated in the timed run, once)
    fast_s = run_path(fast, seqs, layer_ids, out / "fast", args.shard_tokens, chunk_size, streaming=True)
    on_disk = {"bfloat16": shard_bytes(out / "fast")}
    shutil.rmtree(out / "fast", ignore_errors=True)
    fp8_s = None
    if args.fp8:
        for rows in fast.capture_rows(seqs[:4], layer_ids, dtype="float8_e4m3fn"):  # warm, as the bf16 run was
            rows.release()
        fp8_s = run_path(fast, seqs, layer_ids, out / "fp8", args.shard_tokens, chunk_size, streaming=True,
                         dtype="float8_e4m3fn")
        on_disk["float8_e4m3fn"] = shard_bytes(out / "fp8")
        shutil.rmtree(out / "fp8", ignore_errors=True)
    result = {
        "device": describe(device), "commit": commit(),
        "command": "python -m eaglepipe.tools.bench_extraction " + " ".join(argv or sys.argv[1:]),
        "target": args.preset or str(args.target), "tokens": tokens, "sequences": len(seqs), "layer_ids": layer_ids,
        "chunk_size": chunk_size,
        "fast_tok_s": tokens / fast_s, "matmul_peak_tflops": peak, "disk_write_gb_s": disk,
        "bytes_per_token": bytes_per_token, "compute_limit_tok_s": compute_limit, "disk_limit_tok_s": disk_limit,
        "limit_tok_s": min(compute_limit, disk_limit), "matmul_params": params, "packed_check": check,
        "max_batch_tokens": args.max_batch_tokens, "writer_tok_s": writer, "sha256_gb_s": sha,
    }
    if fp8_s is not None:
        result.update(extract_tok_s_bf16=tokens / fast_s, extract_tok_s_fp8=tokens / fp8_s,
                      bytes_per_token_bf16=on_disk["bfloat16"] / tokens,
                      bytes_per_token_fp8=on_disk["float8_e4m3fn"] / tokens)
        print(f"fp8 shards: {result['extract_tok_s_fp8']:,.0f} tok/s against bf16's "
              f"{result['extract_tok_s_bf16']:,.0f}; {result['bytes_per_token_fp8']:,.1f} bytes per token against "
              f"{result['bytes_per_token_bf16']:,.1f} "
              f"({result['bytes_per_token_fp8'] / result['bytes_per_token_bf16']:.3f}x)")
    result["share_of_limit"] = result["fast_tok_s"] / result["limit_tok_s"]
    result["share_of_compute_limit"] = result["fast_tok_s"] / compute_limit
    result["share_of_disk_limit"] = result["fast_tok_s"] / disk_limit
    result["achieved_tflops"] = 2 * params * result["fast_tok_s"] / 1e12
    result["disk_gb_s_used"] = result["fast_tok_s"] * bytes_per_token / 1e9
    print(f"{result['target']}: {tokens:,} tokens in {len(seqs):,} sequences")
    print(f"limits measured now: matmul {peak:.0f} TFLOP/s -> {compute_limit:,.0f} tok/s; disk {disk:.2f} GB/s at "
          f"{bytes_per_token:,} B/token -> {disk_limit:,.0f} tok/s")
    print(f"fast path: {result['fast_tok_s']:,.0f} tok/s written to shards ({100 * result['share_of_limit']:.0f} % of "
          f"the lower limit; {100 * result['share_of_compute_limit']:.0f} % of compute, "
          f"{100 * result['share_of_disk_limit']:.0f} % of disk; {result['achieved_tflops']:.0f} TFLOP/s, "
          f"{result['disk_gb_s_used']:.2f} GB/s)")
    base_seqs = seqs
    if args.baseline_tokens:
        base_seqs, n = [], 0
        for s in seqs:
            if n >= args.baseline_tokens:
                break
            base_seqs.append(s)
            n += len(s)
    # The forward alone (capture_rows, no writer) on the baseline's sequences, the ring already allocated: how much
    # of the shards' time the device work is.
    result["forward_tok_s"] = forward_tok_s(fast, base_seqs, layer_ids)
    result["forward_share_of_compute_limit"] = result["forward_tok_s"] / compute_limit
    # A/B on the same sequences, each variant warmed first (its compiles fall outside the timing): the modules' own
    # q/k/v and gate/up products (what fusing gives), and the elementwise steps eager (what compiling them gives).
    for key, name, value in (("forward_unfused_tok_s", "fuse", False), ("forward_eager_tok_s", "compile", None)):
        if name == "compile" and fast.fast.compile is None:
            continue  # nothing compiles on this device: the forward above is the eager one
        kept = getattr(fast.fast, name)
        setattr(fast.fast, name, value)
        try:
            fast.capture(seqs[:4], layer_ids)
            result[key] = forward_tok_s(fast, base_seqs, layer_ids)
        finally:
            setattr(fast.fast, name, kept)
    ab = "; ".join(f"{label} {result[key]:,.0f} tok/s ({result['forward_tok_s'] / result[key]:.2f}x)"
                   for key, label in (("forward_unfused_tok_s", "without the fused projections"),
                                      ("forward_eager_tok_s", "the elementwise steps eager")) if key in result)
    print(f"forward alone: {result['forward_tok_s']:,.0f} tok/s "
          f"({100 * result['forward_share_of_compute_limit']:.0f} % of compute); {ab}")
    del fast
    if not args.skip_baseline:
        naive = engine_on(model, args.device, args.dtype, False, args.baseline_batch_tokens)
        naive.capture(base_seqs[:4], layer_ids)
        base_s = run_path(naive, base_seqs, layer_ids, out / "naive", args.shard_tokens, chunk_size,
                          streaming=False)
        shutil.rmtree(out / "naive", ignore_errors=True)
        result["naive_tok_s"] = sum(map(len, base_seqs)) / base_s
        result["ratio_to_naive"] = result["fast_tok_s"] / result["naive_tok_s"]
        print(f"naive path: {result['naive_tok_s']:,.0f} tok/s; ratio {result['ratio_to_naive']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
