"""Logging of a rule's script into the rule's log file, and progress lines for long jobs."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time

log = logging.getLogger(__name__)


def to_file(path) -> None:
    """Send everything the job prints to `path` (the rule's log): log records with timestamps, warnings, an
    uncaught error's traceback, the stacks on SIGUSR1, and the output of processes it starts (vLLM's engine and
    workers)."""
    if path:
        log_file = open(path, "a", buffering=1)
        os.dup2(log_file.fileno(), 2)  # file descriptor level, so child processes write here too
        sys.stderr = log_file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr)], force=True)
    logging.captureWarnings(True)
    # `kill -USR1 <pid>` prints every thread's stack to the log: where a job that seems stuck is.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


class Progress:
    """Log lines with done/total, rate and ETA, at most every `every` seconds."""

    def __init__(self, what: str, total: int, unit: str, every: float = 10.0):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.start = self.last = time.monotonic()
        self.done = self.amount = 0

    def update(self, done: int, amount: int) -> None:
        self.done += done
        self.amount += amount
        now = time.monotonic()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            log.info("%s: %d/%d, %.1f %s, elapsed %.0fs, ETA %.0fs", self.what, self.done, self.total,
                     self.amount / elapsed, self.unit, elapsed, eta)
