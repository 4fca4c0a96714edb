"""Validation stage: every hidden-state shard against the manifest and its trace shard, before training reads it.

A shard passes when its sha256_tree (formats.py) equals the one its hidden_states job recorded as it wrote the shard
(the manifest gathers those records), its tensors have the format's keys, dtypes and shapes (in the manifest's dtype),
its tokens are exactly the trace rows' tokens (same ids, same order, same truncation), its layer ids and target
fingerprint are the manifest's, and its hidden states (and fp8 scales) hold no NaN or Inf. validation.json lists each
shard's checks.
Shards are checked in parallel (one thread each, up to the job's threads; hashing and the block-wise NaN scan release
the GIL), and the states are read through a memory map a block of rows at a time, so a shard of any size needs no
more memory than a block.
"""


from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from .formats import STATE_KEYS, read_hidden_shard, read_table, rebuild, sha256_tree, shard_dtype, write_json
from .hidden_states import sequences_of

log = logging.getLogger(__name__)
FINITE_BLOCK_ROWS = 1 << 16  # rows of aux/final scanned for NaN/Inf at a time


class ShardError(ValueError):
    pass


def check_checksum(path, entry: dict) -> None:
    """The shard's bytes on disk against the sha256_tree its hidden_states job recorded when it wrote them."""
    where = f"hidden-state shard {path}"
    if not Path(path).is_file():
        raise ShardError(f"{where}: missing; re-extract it with {rebuild(path)}")
    if "sha256_tree" not in entry:
        raise ShardError(f"{where}: the manifest has no sha256_tree for it (written by an earlier eaglepipe); "
                         f"re-extract every shard with {rebuild('hidden_states')}")
    digest = sha256_tree(path)
    if digest != entry["sha256_tree"]:
        raise ShardError(f"{where}: sha256_tree {digest[:12]}... differs from the manifest's "
                         f"{entry['sha256_tree'][:12]}..., "
                         "recorded by its hidden_states job when it wrote the shard: the file changed after "
                         f"extraction (disk or copy damage?); re-extract it with {rebuild(path)}")


def parallel(function, items, threads: int) -> list:
    """function over items on up to `threads` threads, results in the items' order; the first error is raised."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [function(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(function, items))


def verify_shards(manifest_path, shard_paths, threads: int = 1) -> None:
    """Before training or evaluation reads them: every shard's bytes against its recorded sha256_tree (ShardError)."""
    manifest = json.loads(Path(manifest_path).read_text())
    recorded = {os.path.normpath(e["path"]): e for e in manifest["shards"]}
    for path in shard_paths:
        if os.path.normpath(path) not in recorded:
            raise ShardError(f"hidden-state shard {path}: not listed in {manifest_path}; gather the shards' records "
                             f"again with {rebuild(manifest_path)}")
    parallel(lambda path: check_checksum(path, recorded[os.path.normpath(path)]), shard_paths, threads)
    log.info("%d shards match the sha256_tree recorded when they were written", len(shard_paths))


def check_shard(entry: dict, manifest: dict, trace_path, max_length: int) -> None:
    """Raise ShardError naming the shard and what is wrong with it."""
    path = Path(entry["path"])
    where = f"hidden-state shard {path}"
    check_checksum(path, entry)
    try:
        tensors, meta = read_hidden_shard(path, states=False)
    except Exception as err:  # safetensors raises its own types for damaged headers
        raise ShardError(f"{where}: unreadable ({err})") from None
    if (meta.get("layer_ids") != manifest["layer_ids"]
            or meta.get("target_fingerprint") != manifest["target_fingerprint"]):
        raise ShardError(f"{where}: layer ids {meta.get('layer_ids')} / target {meta.get('target_fingerprint')} "
                         f"differ from the manifest's {manifest['layer_ids']} / {manifest['target_fingerprint']}; "
                         f"re-extract it with {rebuild(path)}")
    dtype = shard_dtype(path)
    if dtype != manifest.get("dtype", "bfloat16"):
        raise ShardError(f"{where}: holds {dtype} states but the manifest says {manifest.get('dtype')}; re-extract "
                         f"it with {rebuild(path)}")
    ids, seqs, masks = sequences_of(read_table(trace_path), max_length)
    expected = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    if meta.get("ids") != ids or not torch.equal(tensors["input_ids"], expected):
        raise ShardError(f"{where}: its tokens are not those of {trace_path} ({tensors['input_ids'].numel()} vs "
                         f"{expected.numel()} tokens); re-extract it with {rebuild(path)}")
    if int(tensors["loss_mask"].sum()) != sum(map(sum, masks)) or entry["tokens"] != expected.numel():
        raise ShardError(f"{where}: loss-mask or token counts differ from the traces and the manifest")
    check_finite(path, where)


def check_finite(path, where: str, block_rows: int = FINITE_BLOCK_ROWS) -> None:
    """No NaN or Inf in the shard's states (and fp8 scales), read a block of rows at a time through a memory map."""
    with safe_open(str(path), framework="pt") as f:
        scales = set(f.keys()) & {"aux_scale", "final_scale"}  # fp8 shards
        for key in [*STATE_KEYS, *sorted(scales)]:
            view = f.get_slice(key)
            rows = view.get_shape()[0]
            bad_total, first = 0, None
            for start in range(0, rows, block_rows):
                bad = non_finite(view[start:start + block_rows])
                count = int(bad.sum())
                if count and first is None:
                    first = start + int(bad.nonzero()[0][0])
                bad_total += count
            if bad_total:
                raise ShardError(f"{where}: {bad_total} NaN/Inf values in '{key}', first at token {first}")


def non_finite(block: torch.Tensor) -> torch.Tensor:
    """Where a block of states is NaN or Inf; e4m3fn has no Inf and one NaN code per sign (all bits but the sign set),
    so fp8 blocks are tested on their bytes, without a float copy."""
    if block.dtype == torch.float8_e4m3fn:
        return (block.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(block)


def run(manifest_path, trace_paths: dict[str, str], output_path, *, max_length: int, threads: int = 1,
        target_fingerprint: str | None = None) -> None:
    """Check every shard (check_shard) and write validation.json; target_fingerprint: the configured target's, which
    the manifest (and through it every shard) must name."""
    manifest = json.loads(Path(manifest_path).read_text())
    if target_fingerprint is not None and manifest["target_fingerprint"] != target_fingerprint:
        raise ShardError(f"{manifest_path}: target_fingerprint {manifest['target_fingerprint']!r} is not the "
                         f"configured target's {target_fingerprint!r}: the hidden states come from other weights; "
                         f"re-extract them with {rebuild('hidden_states')}")

    def one(entry: dict) -> dict:
        name = Path(entry["path"]).relative_to(Path(entry["path"]).parents[1]).with_suffix("").as_posix()
        check_shard(entry, manifest, trace_paths[name], max_length)
        log.info("%s ok (%d tokens)", entry["path"], entry["tokens"])
        return {"path": entry["path"], "sha256_tree": entry["sha256_tree"], "tokens": entry["tokens"], "ok": True}

    checked = parallel(one, manifest["shards"], threads)
    write_json(output_path, {"shards": checked, "checks": ["sha256_tree", "format", "tokens match traces",
                                                           "layer ids and target", "finite"]})
