"""Data formats shared by the stages, defined once: trace shards, hidden-state shards, the manifest.

Trace shard (Parquet, one row per conversation), columns:
    id (str), split (str), messages (JSON str: the prompt conversation), prompt_ids (list<int32>: the exact ids
    given to the engine), output_ids (list<int32>: the exact ids the engine generated), text (str: decoded output,
    special tokens and thinking markers included), reasoning and response (str: the output split at the reasoning
    markers, for people; never training data), reasoning_status (str: "complete" | "unterminated" | "absent", ""
    when the target has no markers), loss_spans (list<int32>: flattened [start, end) positions of prompt_ids +
    output_ids that the engine generated: output_ids, plus earlier regenerated turns in multi_turn "all"),
    turns (int32: assistant turns regenerated), finish_reason (str: "stop" | "length" | "error"),
    prompt_tokens (int32), output_tokens (int32), error (str, empty when none).
    messages is the conversation prompt_ids renders (regenerated earlier turns included). The loss mask of a row is
    1 inside loss_spans and 0 elsewhere.

Hidden-state shard (safetensors), packed tokens of one trace shard's successful rows in id order:
    input_ids  int32  [T]        prompt_ids + output_ids of each row, concatenated
    loss_mask  uint8  [T]        1 on generated tokens
    cu_seqlens int64  [S+1]      sequence boundaries: row s spans cu_seqlens[s]:cu_seqlens[s+1]
    aux        bf16   [T, 3, H]  target hidden states at the aux layer ids ("input of layer k")
    final      bf16   [T, H]     the target's final hidden state after its final norm
    metadata: one key "eaglepipe" holding sorted JSON {ids, layer_ids, layer_convention, target_fingerprint}
        (one key, because safetensors writes a multi-key metadata map in no fixed order: bytes would vary)

Shard record (JSON, shard-i.json beside shard-i.safetensors, written by the same job right after the shard):
    {"shard" (file name), "sha256_tree" (sha256_tree of the bytes the job wrote, hashed as it wrote them, before the
    rename), "bytes", "samples",
    "tokens", "loss_tokens", "layer_ids", "target_fingerprint"}

Manifest (JSON, gathered from the shard records; never from re-hashing the shards):
    {"layer_ids", "layer_convention", "hidden_size", "dtype", "target_fingerprint", "engine",
    "tokens": {split: n}, "shards": [{"path", "split", "samples", "tokens", "loss_tokens", "sha256_tree"}]}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

LAYER_CONVENTION = "input_of_layer"  # id k = hidden state entering decoder layer k (HF output_hidden_states[k])

TRACE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("split", pa.string()),
        ("messages", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("text", pa.string()),
        ("reasoning", pa.string()),
        ("response", pa.string()),
        ("reasoning_status", pa.string()),
        ("loss_spans", pa.list_(pa.int32())),
        ("turns", pa.int32()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("error", pa.string()),
    ]
)

PROMPT_SCHEMA = pa.schema([("id", pa.string()), ("messages", pa.string()), ("source", pa.string())])

SHARD_KEYS = {"input_ids": torch.int32, "loss_mask": torch.uint8, "cu_seqlens": torch.int64,
              "aux": torch.bfloat16, "final": torch.bfloat16}


def rebuild(*targets) -> str:
    """The command that rebuilds workflow outputs (paths, or rule names for all of a rule's outputs) and what was made
    from them: a missing or damaged intermediate whose downstream outputs exist is not rebuilt by a plain run."""
    return (f"`snakemake --cores all --forcerun {' '.join(map(str, targets))}` (add the run's --configfile and "
            "--directory options)")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_table(path, rows: list[dict], schema: pa.Schema) -> None:
    table = pa.Table.from_pylist(rows, schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_table(path, schema: pa.Schema | None = None) -> list[dict]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err}); if the workflow wrote it, rebuild it and "
                         f"what was made from it with {rebuild(path)}; otherwise fix or replace the file") from None
    if schema is not None:
        missing = set(schema.names) - set(table.column_names)
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}; was it written by another version? "
                             f"Rebuild it and what was made from it with {rebuild(path)}")
    return table.to_pylist()


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


TREE_BLOCK = 1 << 24  # bytes per leaf of sha256_tree


def tree_of(leaves: list[bytes]) -> str:
    """sha256_tree from the sha256 digests (32 bytes each) of the blocks, in file order."""
    return hashlib.sha256(b"".join(leaves)).hexdigest()


def sha256_tree(path, threads: int = 4) -> str:
    """The content hash of a hidden-state shard: the sha256 of the concatenated sha256 digests (32 bytes each) of the
    file's TREE_BLOCK-byte blocks in order, the last one shorter. Unlike one sha256 stream (about 1 GB/s on one core,
    slower than the disks a shard is written to), the blocks hash on several cores at once and in any order, so the
    writer hashes a shard as fast as it writes it. The same value from coreutils:
        split -b 16777216 --filter='sha256sum | head -c 64 | xxd -r -p' FILE | sha256sum"""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def leaf(at: int) -> bytes:
            data = os.pread(fd, min(TREE_BLOCK, size - at), at)
            return hashlib.sha256(data).digest()

        starts = range(0, size, TREE_BLOCK)
        if threads <= 1 or len(starts) <= 1:
            return tree_of([leaf(at) for at in starts])
        with ThreadPoolExecutor(threads) as pool:
            return tree_of(list(pool.map(leaf, starts)))
    finally:
        os.close(fd)


def stable_hash(text: str) -> int:
    """A 64-bit hash that does not change between runs or machines (unlike Python's hash())."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


_DTYPE_NAMES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
                "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool, "I8": torch.int8}


def write_hidden_shard(path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    for key, dtype in SHARD_KEYS.items():
        if tensors[key].dtype != dtype:
            raise TypeError(f"hidden-state shard {path}: {key} must be {dtype}, got {tensors[key].dtype}")
    with atomic_path(path) as tmp:
        save_file({k: tensors[k].contiguous() for k in SHARD_KEYS}, str(tmp),
                  metadata={"eaglepipe": json.dumps(metadata, sort_keys=True)})


STATE_KEYS = ("aux", "final")  # the large tensors of a shard; the others are per-token ids and masks


def read_hidden_shard(path, *, states: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Load one hidden-state shard and check its keys, dtypes and shapes against the format. states=False leaves
    the large aux and final tensors on disk: the result holds the ids and masks, and the states' shapes are
    checked from the header (read them with safe_open's get_slice, a block at a time)."""
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = set(SHARD_KEYS) - keys
        if missing:
            raise ValueError(f"hidden-state shard {path}: missing tensors {sorted(missing)}")
        tensors = {k: f.get_tensor(k) for k in SHARD_KEYS if states or k not in STATE_KEYS}
        slices = {k: f.get_slice(k) for k in SHARD_KEYS}
        layout = {k: (tuple(v.get_shape()), _DTYPE_NAMES.get(v.get_dtype(), v.get_dtype())) for k, v in slices.items()}
        metadata = json.loads((f.metadata() or {}).get("eaglepipe", "{}"))
    t = tensors["input_ids"].shape[0]
    cu = tensors["cu_seqlens"]
    problems = []
    for key, dtype in SHARD_KEYS.items():
        if layout[key][1] != dtype:
            problems.append(f"{key} has dtype {layout[key][1]}, expected {dtype}")
    if layout["loss_mask"][0] != (t,):
        problems.append(f"loss_mask shape {layout['loss_mask'][0]} != ({t},)")
    if len(layout["aux"][0]) != 3 or layout["aux"][0][0] != t:
        problems.append(f"aux shape {layout['aux'][0]} does not start with {t} tokens")
    if len(layout["final"][0]) != 2 or layout["final"][0][0] != t:
        problems.append(f"final shape {layout['final'][0]} does not start with {t} tokens")
    if cu.ndim != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        problems.append("cu_seqlens is not a non-decreasing sequence from 0 to the token count")
    if problems:
        raise ValueError(f"hidden-state shard {path}: " + "; ".join(problems))
    return tensors, metadata
