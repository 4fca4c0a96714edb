"""The machine's own limits, measured in the same run as a benchmark so that its ratios are against this machine."""

from __future__ import annotations

import hashlib
import os
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


def disk_write_gb_s(folder, gigabytes: float = 4.0) -> float:
    """Sequential write rate to `folder`, fsync included, in 64 MiB blocks; the file is removed afterwards."""
    path = Path(folder) / ".eaglepipe-disk-probe"
    block = os.urandom(1 << 26)
    blocks = max(1, int(gigabytes * 1e9) // len(block))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(blocks):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
        elapsed = time.perf_counter() - start
        path.unlink(missing_ok=True)
    return blocks * len(block) / elapsed / 1e9


def sha256_gb_s(gigabytes: float = 1.0) -> float:
    """One sha256 stream over bytes in memory, in 16 MiB updates (the shard writer's hasher: a shard's checksum is
    one sequential stream, so this bounds the rate a shard can be written and checksummed)."""
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
