"""GPU assignment for local runs: each GPU job gets its own devices through CUDA_VISIBLE_DEVICES.

Snakemake's `resources: gpu=N` (capped by the profile at the node's count) guarantees that enough GPUs are free in
total, not which ones. A job claims N device slots by taking exclusive locks on files in a lock folder; the kernel
drops the locks when the job's process ends, however it ends, so a crashed job never holds a GPU. On a cluster the
scheduler sets CUDA_VISIBLE_DEVICES itself and nothing is claimed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from .locks import try_lock

log = logging.getLogger(__name__)

_held: list[int] = []  # open lock files of this process: closing them would release the GPUs


def visible_gpus() -> int:
    """GPUs on this machine (EAGLEPIPE_NUM_GPUS overrides, e.g. for tests)."""
    if "EAGLEPIPE_NUM_GPUS" in os.environ:
        return int(os.environ["EAGLEPIPE_NUM_GPUS"])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def claim(count: int, lock_dir=".snakemake/eaglepipe-gpu-locks", wait_s: float = 1.0) -> list[int]:
    """Lock `count` free GPU slots for this process (waiting until they are free) and make them its
    CUDA_VISIBLE_DEVICES; returns their ids."""
    if count <= 0:
        return []
    if "SLURM_JOB_ID" in os.environ:
        log.info("SLURM job %s: %s GPUs on the node, CUDA_VISIBLE_DEVICES=%s set by SLURM", os.environ["SLURM_JOB_ID"],
                 os.environ.get("SLURM_GPUS_ON_NODE", "no"), os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"))
        return []
    if "CUDA_VISIBLE_DEVICES" in os.environ and not _held:
        log.info("CUDA_VISIBLE_DEVICES=%s set by the caller; not claiming GPUs", os.environ["CUDA_VISIBLE_DEVICES"])
        return []
    total = visible_gpus()
    if total < count:
        raise RuntimeError(f"this job declares gpu={count} but the machine has {total} GPUs; lower engine.gpus / "
                           "train.gpus or run on a machine with more GPUs")
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    waited = 0.0
    while (mine := _try_lock(count, total, Path(lock_dir))) is None:
        # All or nothing, then wait: holding part of a claim while waiting could deadlock two multi-GPU jobs. Busy
        # slots mean more GPU jobs run than the machine has GPUs (the profile's gpu cap is above the node's count)
        # or a process outside the workflow holds them; either way the job waits rather than fail or share a GPU.
        if waited % 300 == 0:
            log.warning("waiting for %d free GPU(s) of %d (locks in %s): set `resources: gpu=%d` in the profile to "
                        "match this machine", count, total, lock_dir, total)
        time.sleep(wait_s)
        waited += wait_s
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, mine))
    log.info("claimed GPUs %s", os.environ["CUDA_VISIBLE_DEVICES"])
    return mine


def _try_lock(count: int, total: int, lock_dir: Path) -> list[int] | None:
    """Lock `count` free slots, or none at all."""
    fds, mine = [], []
    for gpu in range(total):
        fd = try_lock(lock_dir / f"gpu-{gpu}.lock")
        if fd is None:
            continue
        fds.append(fd)
        mine.append(gpu)
        if len(mine) == count:
            _held.extend(fds)
            return mine
    for fd in fds:
        os.close(fd)
    return None
