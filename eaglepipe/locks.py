"""Exclusive locks that the kernel releases when their process ends, however it ends (flock on a lock file): the GPU
slots of gpus.py, and each shard while its job writes it, so a second run started beside the first (after
`snakemake --unlock`) fails at once instead of writing the same file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path


class LockedError(RuntimeError):
    pass


def try_lock(path) -> int | None:
    """An open descriptor holding the exclusive lock of `path` (created if missing); None when another process
    holds it. Closing the descriptor, or the process ending, releases it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def writing(output_path, what: str) -> Iterator[Path]:
    """Hold the lock of `output_path` (the file .<name>.lock beside it, which names the holder: pid and host) while
    it is written; raise LockedError naming the output and the holder when another process holds it."""
    output_path = Path(output_path)
    lock = output_path.with_name(f".{output_path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = try_lock(lock)
    if fd is None:
        holder = lock.read_text().strip() or "another process"
        raise LockedError(f"{what} {output_path} is being written by {holder} (lock {lock}); two runs of the workflow "
                          "are writing the same outputs: let the other finish, or stop it (kill the pid), then "
                          "run again")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        yield lock
    finally:
        os.close(fd)
