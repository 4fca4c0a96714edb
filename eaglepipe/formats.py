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
  With hidden_states.dtype float8_e4m3fn (half the bytes), aux and final hold e4m3 values and two more tensors
  hold their scales; a state is values * scale (dequantize), computed by the reader on the device that trains:
    aux        f8e4m3 [T, 3, H]  aux / aux_scale[..., None], rounded to e4m3
    final      f8e4m3 [T, H]
    aux_scale  f32    [T, 3]     amax of the row / 448 (e4m3's largest value); 1 for a row of zeros
    final_scale f32   [T]
  The values are quantized from the bf16 states, so an fp8 shard is exactly quantize() of the bf16 shard of the
  same extraction. Each element is within half a step of e4m3's 3-bit mantissa, or half its subnormal step near
  zero: |dequantized - x| <= 2^-4 |x| + 2^-10 scale (tests/test_fp8.py checks it on SmolLM2-135M's states: about 2 %
  relative error per row, 2.9 % at worst). One scale per token row and layer, because rows differ by orders of
  magnitude (on SmolLM2-135M the largest aux row's amax is 230x the median row's; larger models' first tokens
  carry activations in the thousands): a scale shared by many rows is set by the largest and leaves the others
  fewer of e4m3's binades (the same states with one scale per shard: 3.7 % to 4.1 % on the worst row), while a
  row's own scale puts its largest element at 448. A row is also the unit the streaming writer writes and the
  reader slices, so the scales need no other indexing. They cost 4 bytes per H values (0.7 % at H = 576).
  Bytes per token of either dtype: bytes_per_token(); a shard's dtype is read from its header (shard_dtype) and
  one training or evaluation run takes shards of one dtype only (common_dtype).

Shard record (JSON, shard-i.json beside shard-i.safetensors, written by the same job right after the shard):
    {"shard" (file name), "sha256_tree" (sha256_tree of the bytes the job wrote, hashed as it wrote them, before the
    rename), "bytes", "samples",
    "tokens", "loss_tokens", "layer_ids", "target_fingerprint", "dtype" (of the states; absent before fp8 shards:
    bfloat16)}

Manifest (JSON, gathered from the shard records; never from re-hashing the shards):
    {"layer_ids", "layer_convention", "hidden_size", "dtype" (the states' dtype, one for all shards),
    "target_fingerprint", "engine",
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

STATE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}  # hidden_states.dtype
FP8_MAX = 448.0  # the largest finite e4m3fn value


def shard_keys(dtype: str = "bfloat16") -> dict[str, torch.dtype]:
    """The tensors of a hidden-state shard whose states are stored in `dtype`, and their dtypes."""
    keys = {"input_ids": torch.int32, "loss_mask": torch.uint8, "cu_seqlens": torch.int64,
            "aux": STATE_DTYPES[dtype], "final": STATE_DTYPES[dtype]}
    if dtype != "bfloat16":
        keys.update(aux_scale=torch.float32, final_scale=torch.float32)
    return keys


SHARD_KEYS = shard_keys()


def bytes_per_token(dtype: str, num_aux: int, hidden_size: int) -> int:
    """Bytes a token takes in a hidden-state shard (the header and cu_seqlens aside): its aux and final states in
    `dtype`, their scales (fp8), its token id and loss mask. Every estimate of shard sizes uses this."""
    value = STATE_DTYPES[dtype].itemsize
    scales = 0 if dtype == "bfloat16" else (num_aux + 1) * 4
    return (num_aux + 1) * hidden_size * value + scales + 4 + 1


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn values and a float32 scale per row of the last dimension, on x's device: x ~ values * scale."""
    scale = x.abs().amax(-1).float() / FP8_MAX  # the largest magnitude is one of the values: exact in x's dtype
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of zeros: any scale, zeros stay exact
    # one float32 copy, divided in place: on the device this runs beside the target's own activations
    values = x.to(torch.float32, copy=True).div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return values.to(torch.float8_e4m3fn), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """States in `dtype` from a shard's stored values and scales (None: bf16 values, no scale)."""
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def encode(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """States as a shard of `dtype` stores them, on x's device: bf16 values (no scale) or quantize() of those."""
    x = x.to(torch.bfloat16)
    return (x, None) if dtype == "bfloat16" else quantize(x)


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
                "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool, "I8": torch.int8,
                "F8_E4M3": torch.float8_e4m3fn}


def dtype_of(aux_dtype) -> str:
    """The hidden_states.dtype a shard's aux tensor dtype stands for (bfloat16 for any but fp8)."""
    return "float8_e4m3fn" if aux_dtype == torch.float8_e4m3fn else "bfloat16"


def write_hidden_shard(path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """The whole shard at once; its layout (bf16 or fp8) follows tensors["aux"]'s dtype."""
    keys = shard_keys(dtype_of(tensors["aux"].dtype))
    for key, dtype in keys.items():
        if key not in tensors or tensors[key].dtype != dtype:
            raise TypeError(f"hidden-state shard {path}: {key} must be {dtype}, got "
                            f"{tensors[key].dtype if key in tensors else 'nothing'}")
    with atomic_path(path) as tmp:
        save_file({k: tensors[k].contiguous() for k in keys}, str(tmp),
                  metadata={"eaglepipe": json.dumps(metadata, sort_keys=True)})


STATE_KEYS = ("aux", "final")  # the large tensors of a shard; the others are per-token ids, masks and scales


def shard_dtype(path) -> str:
    """The dtype a shard's states are stored in, from its header."""
    with safe_open(str(path), framework="pt") as f:
        if "aux" not in set(f.keys()):
            raise ValueError(f"hidden-state shard {path}: missing tensors ['aux']")
        return dtype_of(_DTYPE_NAMES.get(f.get_slice("aux").get_dtype()))


def common_dtype(paths) -> str:
    """The one dtype of these shards' states; a run given shards of two dtypes is refused, naming a shard."""
    first, dtype = None, None
    for path in paths:
        this = shard_dtype(path)
        if dtype is None:
            first, dtype = path, this
        elif this != dtype:
            raise ValueError(f"hidden-state shard {path} holds {this} states but {first} holds {dtype}: one run "
                             "takes shards of one hidden_states.dtype; re-extract them all with "
                             f"{rebuild('hidden_states')}")
    return dtype or "bfloat16"


def read_hidden_shard(path, *, states: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Load one hidden-state shard and check its keys, dtypes and shapes against the format (the bf16 or the fp8
    layout, after its aux tensor's dtype). states=False leaves the large aux and final tensors on disk: the result
    holds the ids, masks and scales, and the states' shapes are checked from the header (read them with
    safe_open's get_slice, a block at a time)."""
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        layout = shard_keys(dtype_of(_DTYPE_NAMES.get(f.get_slice("aux").get_dtype())) if "aux" in keys
                            else "bfloat16")
        missing = set(layout) - keys
        if missing:
            raise ValueError(f"hidden-state shard {path}: missing tensors {sorted(missing)}")
        tensors = {k: f.get_tensor(k) for k in layout if states or k not in STATE_KEYS}
        slices = {k: f.get_slice(k) for k in layout}
        found = {k: (tuple(v.get_shape()), _DTYPE_NAMES.get(v.get_dtype(), v.get_dtype())) for k, v in slices.items()}
        metadata = json.loads((f.metadata() or {}).get("eaglepipe", "{}"))
    t = tensors["input_ids"].shape[0]
    cu = tensors["cu_seqlens"]
    problems = []
    for key, dtype in layout.items():
        if found[key][1] != dtype:
            problems.append(f"{key} has dtype {found[key][1]}, expected {dtype}")
    if found["loss_mask"][0] != (t,):
        problems.append(f"loss_mask shape {found['loss_mask'][0]} != ({t},)")
    if len(found["aux"][0]) != 3 or found["aux"][0][0] != t:
        problems.append(f"aux shape {found['aux'][0]} does not start with {t} tokens")
    if len(found["final"][0]) != 2 or found["final"][0][0] != t:
        problems.append(f"final shape {found['final'][0]} does not start with {t} tokens")
    for key in ("aux", "final"):
        if f"{key}_scale" in layout and found[f"{key}_scale"][0] != found[key][0][:-1]:
            problems.append(f"{key}_scale shape {found[key + '_scale'][0]} != {found[key][0][:-1]} (one per row)")
    if cu.ndim != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        problems.append("cu_seqlens is not a non-decreasing sequence from 0 to the token count")
    if problems:
        raise ValueError(f"hidden-state shard {path}: " + "; ".join(problems))
    return tensors, metadata
