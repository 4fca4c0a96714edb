"""Hidden-state stage: the target's aux and final hidden states for the tokens of one trace shard.

Each job writes its shard and, beside it, the shard's record (shard-i.json): the sha256_tree of the bytes it wrote
(hashed as they were written, before the rename, so it is what extraction produced, never what is on disk later)
and its counts. The manifest only gathers these records; validation and training compare the bytes on disk against them.
Shard and manifest formats are defined in formats.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from . import locks
from .engines import open_engine
from .engines.base import EngineSettings
from .formats import (
    LAYER_CONVENTION,
    TRACE_SCHEMA,
    atomic_path,
    read_table,
    rebuild,
    sha256_file,
    sha256_tree,
    shard_dtype,
    write_hidden_shard,
    write_json,
)
from .logs import Progress
from .shard_writer import StreamingShard
from .target import fingerprint, read_info, resolve_layer_ids
from .resume import Units, resume_key

log = logging.getLogger(__name__)


def loss_mask(spans: list[int], length: int) -> list[int]:
    """1 on the positions the engine generated (the trace row's loss_spans), 0 elsewhere; spans reaching past
    `length` (a sequence cut shorter than its trace) are clipped, so the mask is always `length` long."""
    mask = [0] * length
    for start, end in zip(spans[::2], spans[1::2]):
        start, end = min(start, length), min(end, length)
        mask[start:end] = [1] * max(end - start, 0)
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


def write_record(record_path, shard_path, *, digest: str, tensors: dict, metadata: dict) -> dict:
    """The record of a shard just written: its file name, the sha256_tree of its bytes, its counts and settings."""
    record = {"shard": Path(shard_path).name, "sha256_tree": digest, "bytes": Path(shard_path).stat().st_size,
              "samples": len(metadata["ids"]), "tokens": int(tensors["input_ids"].numel()),
              "loss_tokens": int(tensors["loss_mask"].sum()), "layer_ids": metadata["layer_ids"],
              "target_fingerprint": metadata["target_fingerprint"], "dtype": shard_dtype(shard_path)}
    write_json(record_path, record)
    return record


def write_shard(output_path, record_path, tensors: dict, metadata: dict) -> dict:
    """Write the shard from whole tensors under a temporary name, hash those bytes, rename it into place, then write
    its record (the reference for extract's streamed bytes; tests compare them)."""
    with atomic_path(output_path) as tmp:
        write_hidden_shard(tmp, tensors, metadata)
        digest = sha256_tree(tmp)
    return write_record(record_path, output_path, digest=digest, tensors=tensors, metadata=metadata)


def shard_tensors(seqs: list[list[int]], masks: list[list[int]]) -> dict:
    """The shard's small tensors, known before capture: input_ids, loss_mask, cu_seqlens."""
    if len(seqs) != len(masks):
        raise ValueError(f"{len(seqs)} sequences but {len(masks)} loss masks")
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        if len(seq) != len(mask):
            raise ValueError(f"sequence {i}: {len(seq)} tokens but a loss mask of {len(mask)}")
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    return {"input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "loss_mask": torch.tensor([m for ms in masks for m in ms], dtype=torch.uint8),
            "cu_seqlens": torch.cumsum(lengths, 0)}


def runs_of(indices: list[int], lengths: list[int], starts: list[int]) -> list[tuple[int, int, int]]:
    """(shard_row, row, n) runs for a batch holding the sequences `indices` one after another: rows of sequences
    that follow each other in the shard merge into one run (one write)."""
    runs, row = [], 0
    for i in indices:
        n = lengths[i]
        if runs and runs[-1][0] + runs[-1][2] == starts[i]:
            shard_row, first, count = runs[-1]
            runs[-1] = (shard_row, first, count + n)
        else:
            runs.append((starts[i], row, n))
        row += n
    return [r for r in runs if r[2]]


def extract(eng, output_path, seqs: list[list[int]], small: dict, metadata: dict, layer_ids: list[int], *,
            hidden: int, chunk_size: int, units: Units | None = None, progress: Progress | None = None,
            dtype: str = "bfloat16") -> str:
    """Capture every sequence's rows and stream them into the shard at output_path, its states in `dtype` (encoded
    by the engine, on its device); returns its sha256_tree.

    Chunks of chunk_size sequences are the units of resume: when a chunk's rows are on disk (in the shard's partial
    file, fdatasync'd), its row range is recorded in `units`; a rerun with the same units reopens the partial file
    and captures only the chunks not recorded. The engine's batches never mix chunks."""
    starts = small["cu_seqlens"].tolist()
    lengths = [len(s) for s in seqs]
    chunks = [range(a, min(a + chunk_size, len(seqs))) for a in range(0, len(seqs), chunk_size)]
    rows_of = [(starts[c.start], starts[c.stop]) for c in chunks]
    done = {}
    if units is not None:
        for c in range(len(chunks)):
            stored = units.load(c)
            if stored is not None:
                if tuple(stored.get("rows", ())) != rows_of[c]:
                    raise RuntimeError(f"{units.path(c)}: records rows {stored.get('rows')}, not chunk {c}'s "
                                       f"{list(rows_of[c])}; delete {units.folder} and rerun")
                done[c] = rows_of[c]
    writer = StreamingShard(output_path, **small, n_aux=len(layer_ids), hidden=hidden, metadata=metadata,
                            dtype=dtype, keep=list(done.values()), keep_partial=units is not None)
    with writer:
        if done and not writer.kept:
            units.discard(f"the partial file {writer.tmp} is missing or belongs to another shard")
            done = {}
        for c in done:
            if progress is not None:
                progress.update(len(chunks[c]), rows_of[c][1] - rows_of[c][0])
        todo = [c for c in range(len(chunks)) if c not in done]
        order = [i for c in todo for i in chunks[c]]  # the sequences to capture, chunk after chunk
        chunk_of = {i: c for c in todo for i in chunks[c]}
        left = {c: len(chunks[c]) for c in todo}
        batches = eng.capture_rows([seqs[i] for i in order], layer_ids, groups=[len(chunks[c]) for c in todo],
                                   dtype=dtype)
        with contextlib.closing(batches):  # closed on failure too: the engine gets its host buffers back
            for rows in batches:
                indices = [order[j] for j in rows.indices]
                expected = sum(lengths[i] for i in indices)
                if tuple(rows.aux.shape[:2]) != (expected, len(layer_ids)) or rows.final.shape[0] != expected:
                    rows.release()
                    raise RuntimeError(f"engine returned aux {tuple(rows.aux.shape)} / final "
                                       f"{tuple(rows.final.shape)} for {len(indices)} sequences of {expected} tokens "
                                       f"with {len(layer_ids)} layers")
                writer.write_runs(runs_of(indices, lengths, starts), rows.aux, rows.final, release=rows.release,
                                  aux_scale=rows.aux_scale, final_scale=rows.final_scale)
                for i in indices:
                    c = chunk_of[i]
                    left[c] -= 1
                    if left[c] == 0:
                        if units is not None:
                            writer.mark(lambda c=c: units.save(c, {"rows": list(rows_of[c])}))
                        if progress is not None:
                            progress.update(len(chunks[c]), rows_of[c][1] - rows_of[c][0])
        return writer.close()


def run(trace_path, output_path, *, target_dir, layer_ids, engine: dict, max_length: int, chunk_size: int,
        dtype: str = "bfloat16", progress_dir=None, record_path=None) -> None:
    """Stream the shard (shard_writer.StreamingShard), then write its record; the partial file beside the output and
    the progress folder's chunk records are the resume state after a crash."""
    with locks.writing(output_path, "hidden-state shard"):
        info = read_info(target_dir)
        layer_ids = resolve_layer_ids(layer_ids, info)
        ids, seqs, masks = sequences_of(read_table(trace_path, TRACE_SCHEMA), max_length)
        progress = Progress(f"hidden states {trace_path}", len(seqs), "tok/s")
        key = resume_key(sha256_file(trace_path), fingerprint(target_dir), layer_ids, engine, max_length, chunk_size,
                        dtype, Path(__file__).read_text())
        units = Units(progress_dir or Path(output_path).with_name(f".{Path(output_path).name}.progress"), key,
                      f"hidden states {trace_path}")
        small = shard_tensors(seqs, masks)
        metadata = {"ids": ids, "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION,
                    "target_fingerprint": fingerprint(target_dir)}
        with open_engine(target_dir, EngineSettings.from_config(engine)) as eng:
            digest = extract(eng, output_path, seqs, small, metadata, layer_ids, hidden=info.hidden_size,
                             chunk_size=chunk_size, units=units, progress=progress, dtype=dtype)
        write_record(record_path or record_path_of(output_path), output_path, digest=digest, tensors=small,
                     metadata=metadata)
        units.finish(-(-len(seqs) // chunk_size))


def manifest(shard_paths: dict[str, list[str]], record_paths: dict[str, list[str]], output_path, *, target_dir,
             engine: str) -> None:
    """Gather the records the extraction jobs wrote with their shards (checksums, counts); never re-hash a shard:
    the manifest must hold what extraction wrote, not what is on disk now."""
    shards, tokens, layer_ids, dtype = [], {}, None, None
    target = fingerprint(target_dir)
    for split, paths in shard_paths.items():
        tokens[split] = 0
        records = record_paths[split]
        if len(records) != len(paths):
            raise ValueError(f"split {split}: {len(paths)} shards but {len(records)} shard records")
        for path, record_path in zip(paths, records):
            record = json.loads(Path(record_path).read_text())
            if record["shard"] != Path(path).name:
                raise ValueError(f"{record_path}: records shard {record['shard']!r}, not {Path(path).name!r}; "
                                 f"re-extract it with {rebuild(path)}")
            if layer_ids is not None and record["layer_ids"] != layer_ids:
                raise ValueError(f"{path}: layer ids {record['layer_ids']} differ from other shards' {layer_ids}")
            if "sha256_tree" not in record:
                raise ValueError(f"{record_path}: no sha256_tree (an earlier eaglepipe recorded a plain sha256); "
                                 f"re-extract it with {rebuild(path)}")
            if record.get("target_fingerprint") != target:
                raise ValueError(f"{record_path}: target_fingerprint {record.get('target_fingerprint')!r} is not the "
                                 f"target's {target!r} ({target_dir}): the shard was extracted from other weights; "
                                 f"re-extract it with {rebuild(path)}")
            layer_ids = record["layer_ids"]
            record_dtype = record.get("dtype", "bfloat16")  # records from before fp8 shards: bf16
            if dtype is not None and record_dtype != dtype:
                raise ValueError(f"{path}: holds {record_dtype} states but the shards before it hold {dtype}: one "
                                 "run takes shards of one hidden_states.dtype; re-extract them all with "
                                 f"{rebuild('hidden_states')}")
            dtype = record_dtype
            tokens[split] += record["tokens"]
            shards.append({"path": str(path), "split": split, "samples": record["samples"],
                           "tokens": record["tokens"], "loss_tokens": record["loss_tokens"],
                           "sha256_tree": record["sha256_tree"]})
    info = read_info(target_dir)
    write_json(output_path, {
        "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION, "hidden_size": info.hidden_size,
        "dtype": dtype or "bfloat16", "target_fingerprint": target, "engine": engine,
        "tokens": tokens, "shards": shards,
    })
