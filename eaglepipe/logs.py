"""Logging of a rule's script into the rule's log file."""

from __future__ import annotations

import logging
import os
import sys


def to_file(path) -> None:
    """Send everything the job prints to `path` (the rule's log): log records with timestamps, warnings, an
    uncaught error's traceback, and the output of processes it starts (vLLM's engine and workers)."""
    if path:
        log_file = open(path, "a", buffering=1)
        os.dup2(log_file.fileno(), 2)  # file descriptor level, so child processes write here too
        sys.stderr = log_file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr)], force=True)
    logging.captureWarnings(True)
