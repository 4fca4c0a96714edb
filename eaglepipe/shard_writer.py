"""A hidden-state shard written while it is captured: one pass to disk, overlapped with the target's forward passes.

The shard's layout is known before capture starts (its token ids, loss mask and sequence lengths come from the trace
shard), so the safetensors header and the small tensors are written first and each captured batch's `aux` and
`final` rows go straight to their offsets in the file from a writer thread, while the engine runs the next batch.
The bytes equal what `formats.write_hidden_shard` (safetensors' own `save_file`) writes for the same tensors
(tests/test_shard_writer.py compares them); nothing is held in memory beyond the batches in flight.

File layout (safetensors orders tensors by dtype, largest first, then name): 8-byte header length, JSON header, then
cu_seqlens (I64), input_ids (I32), aux (BF16 [T, n_aux, H]), final (BF16 [T, H]), loss_mask (U8); an fp8 shard
(dtype="float8_e4m3fn", formats.py) has aux_scale (F32 [T, n_aux]) and final_scale (F32 [T]) after cu_seqlens, and
F8_E4M3 aux and final. A row's values and scales come in together and are written at their offsets alike.

Three threads besides the caller's:
- the writer pwrites row runs at their offsets, then calls the batch's release callback (the engine may then reuse
  the host buffer the rows came from);
- the syncer, for `mark(callback)`: fdatasync's the file, then calls the callback; so a callback (the stage records a
  completed chunk there) only runs once the rows written before it are on disk, never while they are still in the
  page cache of a machine that may crash. The writer also has it sync after every `flush_bytes` written: the kernel
  would otherwise hold gigabytes dirty (its background writeback starts at a share of RAM) and leave them all to
  the fsync at close, after the capture, instead of writing them while the target runs;
- the hashers (a small pool) compute the shard's content hash, formats.sha256_tree, while the file is written: each
  TREE_BLOCK-byte block is hashed as soon as its last byte is written, read back through a read-only mapping (the
  page cache, no copy), on several cores at once. So close waits for the last few blocks only, and hashing never
  bounds the write: one sha256 stream in file order runs at about the disk's rate on one core, and could only take
  the `final` region once every `aux` row was in.

The file is written as `.<name>.partial` beside the output and renamed only when complete, so a crashed job leaves
nothing Snakemake would take as done. The partial file is the resume state: opened with `keep` (row ranges a stage
recorded as complete), an existing partial with the same header is reopened without truncation and only the other
rows need writing; `keep_partial=True` leaves it in place when capture fails.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .formats import TREE_BLOCK, shard_keys, tree_of

# The shard's dtypes (formats.shard_keys) in safetensors' order of tensors: its dtype enum, largest first; then names.
_DTYPES = {torch.int64: ("I64", 8), torch.float32: ("F32", 4), torch.int32: ("I32", 4), torch.bfloat16: ("BF16", 2),
           torch.float8_e4m3fn: ("F8_E4M3", 1), torch.uint8: ("U8", 1)}
_RANK = {dtype: rank for rank, dtype in enumerate(_DTYPES)}
HASH_THREADS = min(4, os.cpu_count() or 1)


def header(specs: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """The safetensors header for tensors of these dtypes and shapes, and each tensor's byte range after it."""
    order = sorted(specs, key=lambda k: (_RANK[specs[k][0]], k))
    entries, offsets, at = {"__metadata__": metadata}, {}, 0
    for name in order:
        dtype, shape = specs[name]
        size = _DTYPES[dtype][1]
        for n in shape:
            size *= n
        entries[name] = {"dtype": _DTYPES[dtype][0], "shape": list(shape), "data_offsets": [at, at + size]}
        offsets[name] = (at, at + size)
        at += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _nothing() -> None:
    pass


class StreamingShard:
    """with StreamingShard(path, small tensors, n_aux, hidden, metadata) as shard: shard.write(start, aux, final) ...;
    digest = shard.close() (formats.sha256_tree of the file). dtype: the states' (formats.STATE_DTYPES)."""

    def __init__(self, path, *, input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                 n_aux: int, hidden: int, metadata: dict, dtype: str = "bfloat16", queue_depth: int = 4,
                 keep: list[tuple[int, int]] = (), keep_partial: bool = False, flush_bytes: int = 1 << 28):
        self.path = Path(path)
        self.tokens = int(input_ids.numel())
        self.n_aux, self.hidden = n_aux, hidden
        self.keys = shard_keys(dtype)
        rows = {"aux": [n_aux, hidden], "final": [hidden], "aux_scale": [n_aux], "final_scale": []}
        self.row_shapes = {k: v for k, v in rows.items() if k in self.keys}  # the tensors written row by row
        specs = {"input_ids": (torch.int32, [self.tokens]), "loss_mask": (torch.uint8, [self.tokens]),
                 "cu_seqlens": (torch.int64, [int(cu_seqlens.numel())]),
                 **{k: (self.keys[k], [self.tokens, *shape]) for k, shape in self.row_shapes.items()}}
        head, self.offsets = header(specs, {"eaglepipe": json.dumps(metadata, sort_keys=True)})
        self.base = len(head)
        self.end = self.base + max(b for _, b in self.offsets.values())
        self.row_bytes = {k: self.keys[k].itemsize * int(torch.Size(shape).numel())
                          for k, shape in self.row_shapes.items()}
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self.keep_partial = keep_partial
        self.flush_bytes, self.unflushed = flush_bytes, 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        small = [(name, _bytes(t.to(specs[name][0]))) for name, t in
                 (("cu_seqlens", cu_seqlens), ("input_ids", input_ids), ("loss_mask", loss_mask))]
        # The partial of an earlier run is reused only when it is this very shard's (same size, header, small tensors).
        self.kept = list(keep) if keep and self._same_partial(head, small) else []
        flags = os.O_RDWR | os.O_CREAT | (0 if self.kept else os.O_TRUNC)
        self.fd = os.open(self.tmp, flags, 0o644)
        os.ftruncate(self.fd, self.end)
        self.error: BaseException | None = None
        # Completed aux rows: a heap of (start, stop) runs and the prefix 0..frontier known complete.
        self.frontier, self.runs, self.lock = 0, [], threading.Condition()
        # The content hash: bytes still to be written in each block; a block is hashed once none are left.
        self.left = [min(TREE_BLOCK, self.end - at) for at in range(0, self.end, TREE_BLOCK)]
        self.leaves: list = [None] * len(self.left)
        self.mapping = mmap.mmap(self.fd, self.end, prot=mmap.PROT_READ) if self.end else None
        self.hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix=f"hash {self.path.name}")
        self._pwrite(head, 0)
        for name, data in small:
            self._pwrite(data, self.base + self.offsets[name][0])
        for start, stop in self.kept:
            self._completed([(start, stop)])
            for name in self.row_bytes:
                self._written(self.base + self.offsets[name][0] + start * self.row_bytes[name],
                              (stop - start) * self.row_bytes[name])
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_depth)  # back-pressure: capture waits for a slow disk
        self.marks: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=fn, name=f"{fn.__name__} {self.path.name}", daemon=True)
                        for fn in (self._drain, self._sync)]
        for t in self.threads:
            t.start()

    def _same_partial(self, head: bytes, small) -> bool:
        try:
            if self.tmp.stat().st_size != self.end:
                return False
            with open(self.tmp, "rb") as f:
                if f.read(len(head)) != head:
                    return False
                for name, data in small:
                    f.seek(self.base + self.offsets[name][0])
                    if f.read(len(data)) != bytes(data):
                        return False
            return True
        except OSError:
            return False

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        at, length = offset, len(view)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n
        self._written(at, length)

    def _written(self, offset: int, length: int) -> None:
        """Bytes offset .. offset + length are in the file: hash each block they complete (on the hashers' pool)."""
        with self.lock:
            for block in range(offset // TREE_BLOCK, (offset + length - 1) // TREE_BLOCK + 1 if length else 0):
                lo, hi = max(offset, block * TREE_BLOCK), min(offset + length, (block + 1) * TREE_BLOCK)
                self.left[block] -= hi - lo
                if self.left[block] < 0:
                    raise RuntimeError(f"{self.tmp}: bytes {lo}..{hi} written twice")
                if self.left[block] == 0:
                    self.leaves[block] = self.hashers.submit(self._leaf, block)

    def _leaf(self, block: int) -> bytes:
        at = block * TREE_BLOCK
        with memoryview(self.mapping) as view:
            return hashlib.sha256(view[at: min(at + TREE_BLOCK, self.end)]).digest()

    def _fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
            self.lock.notify_all()

    # ---- threads ----

    def _drain(self) -> None:
        """The writer: pwrite each job's row runs, release its buffers, advance the completed prefix."""
        while True:
            job = self.jobs.get()
            if job is None:
                self.marks.put(None)
                return
            kind, payload, callback = job
            if kind == "mark":
                self.marks.put(callback)
                continue
            try:
                if self.error is None:
                    tensors, runs = payload
                    for shard_row, row, n in runs:
                        for name, t in tensors.items():
                            self._pwrite(_bytes(t[row: row + n]),
                                         self.base + self.offsets[name][0] + shard_row * self.row_bytes[name])
                    self._completed([(s, s + n) for s, _, n in runs])
                    self.unflushed += sum(n for _, _, n in runs) * sum(self.row_bytes.values())
                    if self.unflushed >= self.flush_bytes:  # keep the disk busy: no backlog left for close's fsync
                        self.marks.put(_nothing)
                        self.unflushed = 0
            except BaseException as err:  # reported to the capturing thread on its next write or at close
                self._fail(err)
            finally:
                callback()  # always: the engine waits for its buffer back

    def _sync(self) -> None:
        """The syncer: fdatasync, then run the callbacks of every mark that came before the sync began."""
        while True:
            callbacks = [self.marks.get()]
            while not self.marks.empty():
                callbacks.append(self.marks.get())
            stop = callbacks[-1] is None
            callbacks = [c for c in callbacks if c is not None]
            if callbacks and self.error is None:
                try:
                    os.fdatasync(self.fd)
                    for c in callbacks:
                        c()
                except BaseException as err:
                    self._fail(err)
            if stop:
                return

    def _completed(self, runs) -> None:
        with self.lock:
            for run in runs:
                heapq.heappush(self.runs, run)
            while self.runs and self.runs[0][0] <= self.frontier:
                self.frontier = max(self.frontier, heapq.heappop(self.runs)[1])
            self.lock.notify_all()

    # ---- the caller's side ----

    def _check(self) -> None:
        if self.error is not None:
            raise OSError(f"writing {self.tmp} failed: {self.error}") from self.error

    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor, aux_scale=None, final_scale=None) -> None:
        """Rows start .. start + len(aux) - 1 of the shard (on the host; pinned memory is fine)."""
        self.write_runs([(start, 0, aux.shape[0])], aux, final, aux_scale=aux_scale, final_scale=final_scale)

    def write_runs(self, runs: list[tuple[int, int, int]], aux: torch.Tensor, final: torch.Tensor,
                   release=None, *, aux_scale: torch.Tensor | None = None,
                   final_scale: torch.Tensor | None = None) -> None:
        """For each (shard_row, row, n) in runs: rows row .. row + n - 1 of aux [rows, n_aux, H] / final [rows, H]
        (the shard's dtype, on the host; with fp8 also aux_scale [rows, n_aux] / final_scale [rows] float32) go to
        shard rows shard_row ... The tensors must stay unchanged until release() is called (from the writer thread,
        once they are written or the write failed)."""
        self._check()
        given = {"aux": aux, "final": final, "aux_scale": aux_scale, "final_scale": final_scale}
        tensors = {k: given[k] for k in self.row_shapes}
        for key, t in given.items():
            shape = (aux.shape[0], *self.row_shapes.get(key, ()))
            if (t is None) != (key not in tensors) or t is not None and (t.shape != shape or t.dtype != self.keys[key]):
                raise ValueError(f"{self.path}: rows of {key} given as "
                                 f"{'nothing' if t is None else (tuple(t.shape), t.dtype)}, expected "
                                 f"{(shape, self.keys[key]) if key in tensors else 'none in this shard'}")
        for shard_row, row, n in runs:
            if shard_row < 0 or shard_row + n > self.tokens or row < 0 or row + n > aux.shape[0]:
                raise ValueError(f"{self.path}: rows {shard_row}..{shard_row + n} (from {row} of {aux.shape[0]}) "
                                 f"do not fit {self.tokens} tokens")
        self.jobs.put(("rows", (tensors, runs), release or _nothing))

    def mark(self, callback) -> None:
        """Call callback (from the syncer thread) once every row written before this call is on disk."""
        self._check()
        self.jobs.put(("mark", None, callback))

    def close(self, ok: bool = True) -> str | None:
        """Finish writing; when ok and every row was written, rename into place and return the file's
        formats.sha256_tree.
        Otherwise remove the partial file (keep it with keep_partial) and, when ok, raise. A second close does
        nothing."""
        if self.fd is None:
            return None
        self.jobs.put(None)
        for t in self.threads:
            t.join()
        complete = self.error is None and self.frontier == self.tokens and not self.runs
        digest = None
        try:  # the last rows go to disk while the hashers finish the last blocks
            if ok and complete:
                os.fsync(self.fd)
                if any(self.left):
                    raise RuntimeError(f"{self.tmp}: {sum(self.left)} bytes never written")
                digest = tree_of([leaf.result() for leaf in self.leaves])
        except Exception as err:  # a failed fsync or block hash: the shard is not complete
            self._fail(err)
        finally:
            self.hashers.shutdown(wait=True, cancel_futures=True)
            if self.mapping is not None:
                self.mapping.close()
            os.close(self.fd)
            self.fd = None
        if not ok or not complete or self.error is not None:
            if not self.keep_partial:
                self.tmp.unlink(missing_ok=True)
            if ok:
                raise RuntimeError(f"{self.path}: {self.frontier} of {self.tokens} rows written"
                                   + (f" ({self.error})" if self.error else ""))
            return None
        os.replace(self.tmp, self.path)
        return digest

    def __enter__(self) -> "StreamingShard":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.close(ok=False)
