"""The machine's own limits, measured in the same run as a benchmark so that its ratios are against this machine."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch


def matmul_peak_tflops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """bf16 matrix-product rate: the mean of `repeats` size^3 products after three warm-ups (CPU: float32, small)."""
    if device.type != "cuda":
        size, dtype = min(size, 1024), torch.float32
    else:
        dtype = torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def disk_write_gb_s(folder, gigabytes: float = 4.0, sync_bytes: int = 1 << 28) -> float:
    """Sequential write rate to `folder` the way the shard writer writes: 64 MiB blocks, while a second thread
    fdatasync's every `sync_bytes` written (so the disk writes during the writes, not only at the end), the final
    fsync included; the file is removed afterwards. One fsync at the end alone would time the copy into the page
    cache and the disk's writing one after the other: on the H100 machine that read 1.2-1.4 GB/s, where the shard
    writer alone wrote shards, synced, at 2 GB/s."""
    path = Path(folder) / ".eaglepipe-disk-probe"
    block = os.urandom(1 << 26)
    blocks = max(1, int(gigabytes * 1e9) // len(block))
    wanted, state = threading.Condition(), {"due": 0, "stop": False}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def syncer():
        while True:
            with wanted:
                wanted.wait_for(lambda: state["due"] or state["stop"])
                if state["stop"]:
                    return
                state["due"] = 0
            os.fdatasync(fd)

    thread = threading.Thread(target=syncer, name="disk probe sync", daemon=True)
    start = time.perf_counter()
    thread.start()
    try:
        written = 0
        for _ in range(blocks):
            os.write(fd, block)
            written += len(block)
            if written >= sync_bytes:
                with wanted:
                    state["due"], written = 1, 0
                    wanted.notify()
    finally:
        with wanted:
            state["stop"] = True
            wanted.notify()
        thread.join()
        os.fsync(fd)
        os.close(fd)
        elapsed = time.perf_counter() - start
        path.unlink(missing_ok=True)
    return blocks * len(block) / elapsed / 1e9


def sha256_gb_s(gigabytes: float = 1.0) -> float:
    """One sha256 stream over bytes in memory, in 16 MiB updates: what one hashing thread reaches (a shard's
    sha256_tree spreads its blocks over shard_writer.HASH_THREADS of them)."""
    block = memoryview(os.urandom(1 << 24))
    blocks = max(1, int(gigabytes * 1e9) // len(block))
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(blocks):
        digest.update(block)
    return blocks * len(block) / (time.perf_counter() - start) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"cpu, {os.cpu_count()} cores (torch {torch.__version__})"


def commit() -> str:
    """EAGLEPIPE_COMMIT when set (a device copy's .git can be stale), else the checkout's HEAD, else 'unknown'."""
    import subprocess

    if os.environ.get("EAGLEPIPE_COMMIT"):
        return os.environ["EAGLEPIPE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
