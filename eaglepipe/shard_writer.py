"""A hidden-state shard written while it is captured: one pass to disk, overlapped with the target's forward passes.

The shard's layout is known before capture starts (its token ids, loss mask and sequence lengths come from the trace
shard), so the safetensors header and the small tensors are written first and each captured chunk's `aux` and
`final` rows go straight to their offsets in the file from a writer thread, while the engine runs the next chunk.
The bytes equal what `formats.write_hidden_shard` (safetensors' own `save_file`) writes for the same tensors
(tests/test_shard_writer.py compares them); nothing is held in memory beyond the chunks in flight.

The file is written under a temporary name beside the output and renamed only when complete, so a crashed job leaves
nothing Snakemake would take as done. The unit of resume on this path is the shard: a rerun captures it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from pathlib import Path

import torch

# safetensors orders tensors by dtype size (largest first), then by name; these are the shard's (formats.SHARD_KEYS).
_DTYPES = {torch.int64: ("I64", 8), torch.int32: ("I32", 4), torch.bfloat16: ("BF16", 2), torch.uint8: ("U8", 1)}


def header(specs: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """The safetensors header for tensors of these dtypes and shapes, and each tensor's byte range after it."""
    order = sorted(specs, key=lambda k: (-_DTYPES[specs[k][0]][1], k))
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


class StreamingShard:
    """with StreamingShard(path, small tensors, aux_shape, metadata) as shard: shard.write(start, aux, final) ..."""

    def __init__(self, path, *, input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                 n_aux: int, hidden: int, metadata: dict, queue_depth: int = 4):
        self.path = Path(path)
        self.tokens = int(input_ids.numel())
        specs = {"input_ids": (torch.int32, [self.tokens]), "loss_mask": (torch.uint8, [self.tokens]),
                 "cu_seqlens": (torch.int64, [int(cu_seqlens.numel())]),
                 "aux": (torch.bfloat16, [self.tokens, n_aux, hidden]), "final": (torch.bfloat16, [self.tokens, hidden])}
        head, self.offsets = header(specs, {"eaglepipe": json.dumps(metadata, sort_keys=True)})
        self.base = len(head)
        self.row_bytes = {"aux": n_aux * hidden * 2, "final": hidden * 2}
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        end = self.base + max(b for _, b in self.offsets.values())
        os.ftruncate(self.fd, end)
        self._pwrite(head, 0)
        for name, t in (("input_ids", input_ids), ("loss_mask", loss_mask), ("cu_seqlens", cu_seqlens)):
            self._pwrite(_bytes(t.to(specs[name][0])), self.base + self.offsets[name][0])
        self.written = 0
        self.error: BaseException | None = None
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_depth)  # back-pressure: capture waits for a slow disk
        self.thread = threading.Thread(target=self._drain, name=f"write {self.path.name}", daemon=True)
        self.thread.start()

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def _drain(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is None:
                try:
                    for name, start, t in job:
                        self._pwrite(_bytes(t), self.base + self.offsets[name][0] + start * self.row_bytes[name])
                except BaseException as err:  # reported to the capturing thread on its next write or at close
                    self.error = err

    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Rows start .. start + len(aux) - 1 of the shard (bf16, on the host; pinned memory is fine)."""
        if self.error is not None:
            raise OSError(f"writing {self.tmp} failed: {self.error}") from self.error
        if start + aux.shape[0] > self.tokens or aux.shape[0] != final.shape[0]:
            raise ValueError(f"{self.path}: rows {start}..{start + aux.shape[0]} do not fit {self.tokens} tokens")
        self.jobs.put([("aux", start, aux), ("final", start, final)])
        self.written += aux.shape[0]

    def close(self, ok: bool = True) -> str | None:
        """Finish writing; when ok and every row was written, rename into place and return the file's sha256."""
        self.jobs.put(None)
        self.thread.join()
        try:
            if ok and self.error is None and self.written == self.tokens:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        if not ok or self.error is not None or self.written != self.tokens:
            self.tmp.unlink(missing_ok=True)
            if ok:
                raise RuntimeError(f"{self.path}: {self.written} of {self.tokens} rows written"
                                   + (f" ({self.error})" if self.error else ""))
            return None
        digest = hashlib.sha256()
        with open(self.tmp, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        os.replace(self.tmp, self.path)
        return digest.hexdigest()

    def __enter__(self) -> "StreamingShard":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.close(ok=False)
