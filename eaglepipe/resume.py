"""Resume inside a job: completed units of work kept in a progress folder until the job's output is written.

The folder is not a declared Snakemake output (Snakemake deletes those before rerunning an incomplete job), so a
rerun after a crash finds the units done so far. Units belong to one key of the job's inputs and settings;
a folder made under another key is discarded whole, so a config or input change never reuses stale work.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from .formats import atomic_path

log = logging.getLogger(__name__)


def resume_key(*parts) -> str:
    """A stable digest of JSON-able parts (settings, input checksums)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Units:
    """Unit i of a job is the file unit-<i>.pt in `folder`, written atomically once the unit is complete."""

    def __init__(self, folder, key: str, what: str):
        self.folder, self.key, self.what = Path(folder), key, what
        self.reused = 0
        stamp = self.folder / "key"
        if self.folder.exists() and (not stamp.is_file() or stamp.read_text() != key):
            stale = len(list(self.folder.glob("unit-*.pt")))
            log.info("%s: discarding %d units of earlier work made with other inputs or settings", what, stale)
            shutil.rmtree(self.folder)
        if not stamp.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(stamp) as tmp:
                tmp.write_text(key)

    def discard(self, why: str) -> None:
        """Forget every unit stored so far (the state they describe is gone) and start the folder afresh."""
        stale = len(list(self.folder.glob("unit-*.pt")))
        if stale:
            log.info("%s: discarding %d units of earlier work: %s", self.what, stale, why)
        for path in self.folder.glob("unit-*.pt"):
            path.unlink()
        self.reused = 0

    def path(self, index: int) -> Path:
        return self.folder / f"unit-{index:06d}.pt"

    def load(self, index: int):
        """The stored result of unit `index`, or None when it has not been completed."""
        path = self.path(index)
        if not path.is_file():
            return None
        self.reused += 1
        return torch.load(path, weights_only=True)

    def save(self, index: int, result) -> None:
        with atomic_path(self.path(index)) as tmp:
            torch.save(result, tmp)

    def finish(self, total: int) -> None:
        """Log the reuse and remove the folder: call once the job's final output is written."""
        log.info("%s: %d of %d units reused from an earlier interrupted run, %d computed", self.what, self.reused,
                 total, total - self.reused)
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # and the parents it leaves empty (results/.progress/<stage>/<split>)
            os.removedirs(self.folder.parent)
