"""Hidden-state stage: the target's aux and final hidden states for the tokens of one trace shard.

Each job writes its shard and, beside it, the shard's record (shard-i.json): the sha256 of the bytes it wrote
(hashed before the rename, so it is what extraction produced, never what is on disk later) and its counts. The
manifest only gathers these records; validation and training compare the bytes on disk against them.
Shard and manifest formats are defined in formats.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .engines import open_engine
from .engines.base import EngineSettings
from .formats import (
    LAYER_CONVENTION,
    TRACE_SCHEMA,
    atomic_path,
    read_table,
    sha256_file,
    write_hidden_shard,
    write_json,
)
from .logs import Progress
from .target import fingerprint, read_info, resolve_layer_ids
from .units import Units
from .units import fingerprint as units_key

log = logging.getLogger(__name__)


def loss_mask(spans: list[int], length: int) -> list[int]:
    """1 on the positions the engine generated (the trace row's loss_spans), 0 elsewhere."""
    mask = [0] * length
    for start, end in zip(spans[::2], spans[1::2]):
        mask[start:end] = [1] * (end - start)
    return mask


def sequences_of(rows: list[dict], max_length: int) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """Ids, token sequences and loss masks of the usable rows, truncated to max_length tokens."""
    ids, seqs, masks = [], [], []
    for row in rows:
        if row["error"] or not row["output_ids"]:
            continue
        tokens = (list(row["prompt_ids"]) + list(row["output_ids"]))[:max_length]
        mask = loss_mask(row["loss_spans"], len(row["prompt_ids"]) + len(row["output_ids"]))[:max_length]
        if sum(mask) == 0:
            continue  # the prompt alone fills max_length: nothing generated to learn from
        ids.append(row["id"])
        seqs.append(tokens)
        masks.append(mask)
    return ids, seqs, masks


def record_path_of(shard_path) -> Path:
    """Where a shard's record lies when no other path is given: shard-i.json beside shard-i.safetensors."""
    return Path(shard_path).with_suffix(".json")


def write_record(record_path, shard_path, *, sha256: str, tensors: dict, metadata: dict) -> dict:
    """The record of a shard just written: its file name, the sha256 of its bytes, its counts and settings."""
    record = {"shard": Path(shard_path).name, "sha256": sha256, "bytes": Path(shard_path).stat().st_size,
              "samples": len(metadata["ids"]), "tokens": int(tensors["input_ids"].numel()),
              "loss_tokens": int(tensors["loss_mask"].sum()), "layer_ids": metadata["layer_ids"],
              "target_fingerprint": metadata["target_fingerprint"]}
    write_json(record_path, record)
    return record


def write_shard(output_path, record_path, tensors: dict, metadata: dict) -> dict:
    """Write the shard under a temporary name, hash those bytes, rename it into place, then write its record."""
    with atomic_path(output_path) as tmp:
        write_hidden_shard(tmp, tensors, metadata)
        digest = sha256_file(tmp)
    return write_record(record_path, output_path, sha256=digest, tensors=tensors, metadata=metadata)


def run(trace_path, output_path, *, target_dir, layer_ids, engine: dict, max_length: int, chunk_size: int,
        progress_dir=None, record_path=None) -> None:
    info = read_info(target_dir)
    layer_ids = resolve_layer_ids(layer_ids, info)
    ids, seqs, masks = sequences_of(read_table(trace_path, TRACE_SCHEMA), max_length)
    progress = Progress(f"hidden states {trace_path}", len(seqs), "tok/s")
    aux, final = [], []
    # Chunks are the units of resume: a rerun after a crash captures only the chunks not yet stored.
    key = units_key(sha256_file(trace_path), fingerprint(target_dir), layer_ids, engine, max_length, chunk_size,
                    Path(__file__).read_text())
    units = Units(progress_dir or Path(output_path).with_name(f".{Path(output_path).name}.progress"), key,
                  f"hidden states {trace_path}")
    with open_engine(target_dir, EngineSettings.from_config(engine)) as eng:
        for start in range(0, len(seqs), chunk_size):
            chunk = seqs[start: start + chunk_size]
            stored = units.load(start // chunk_size)
            if stored is not None:
                aux.append(stored["aux"])
                final.append(stored["final"])
                progress.update(len(chunk), sum(map(len, chunk)))
                continue
            for cap, seq in zip(eng.capture(chunk, layer_ids), chunk):
                if cap.aux.shape[:2] != (len(seq), 3) or cap.final.shape[0] != len(seq):
                    raise RuntimeError(f"engine returned aux {tuple(cap.aux.shape)} / final "
                                       f"{tuple(cap.final.shape)} for a {len(seq)}-token sequence")
                aux.append(cap.aux)
                final.append(cap.final)
            n = len(chunk)
            units.save(start // chunk_size, {"aux": torch.cat(aux[-n:]), "final": torch.cat(final[-n:])})
            progress.update(len(chunk), sum(map(len, chunk)))
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    hidden = info.hidden_size
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "loss_mask": torch.tensor([m for ms in masks for m in ms], dtype=torch.uint8),
        "cu_seqlens": torch.cumsum(lengths, 0),
        "aux": torch.cat(aux) if aux else torch.zeros(0, 3, hidden, dtype=torch.bfloat16),
        "final": torch.cat(final) if final else torch.zeros(0, hidden, dtype=torch.bfloat16),
    }
    metadata = {"ids": ids, "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION,
                "target_fingerprint": fingerprint(target_dir)}
    write_shard(output_path, record_path or record_path_of(output_path), tensors, metadata)
    units.finish(-(-len(seqs) // chunk_size))


def manifest(shard_paths: dict[str, list[str]], record_paths: dict[str, list[str]], output_path, *, target_dir,
             engine: str) -> None:
    """Gather the records the extraction jobs wrote with their shards (checksums, counts); never re-hash a shard:
    the manifest must hold what extraction wrote, not what is on disk now."""
    shards, tokens, layer_ids = [], {}, None
    for split, paths in shard_paths.items():
        tokens[split] = 0
        records = record_paths[split]
        if len(records) != len(paths):
            raise ValueError(f"split {split}: {len(paths)} shards but {len(records)} shard records")
        for path, record_path in zip(paths, records):
            record = json.loads(Path(record_path).read_text())
            if record["shard"] != Path(path).name:
                raise ValueError(f"{record_path}: records shard {record['shard']!r}, not {Path(path).name!r}; "
                                 f"delete {path} and {record_path} so its hidden_states job re-runs")
            if layer_ids is not None and record["layer_ids"] != layer_ids:
                raise ValueError(f"{path}: layer ids {record['layer_ids']} differ from other shards' {layer_ids}")
            layer_ids = record["layer_ids"]
            tokens[split] += record["tokens"]
            shards.append({"path": str(path), "split": split, "samples": record["samples"],
                           "tokens": record["tokens"], "loss_tokens": record["loss_tokens"], "sha256": record["sha256"]})
    info = read_info(target_dir)
    write_json(output_path, {
        "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION, "hidden_size": info.hidden_size,
        "dtype": "bfloat16", "target_fingerprint": fingerprint(target_dir), "engine": engine,
        "tokens": tokens, "shards": shards,
    })
