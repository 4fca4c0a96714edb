"""Logging of a rule's script into the rule's log file."""

from __future__ import annotations

import logging
import sys


def to_file(path) -> None:
    """Send log records, warnings and an uncaught error to `path` (the rule's log) and to stderr."""
    handlers = [logging.StreamHandler(sys.stderr)]
    if path:
        handlers.append(logging.FileHandler(path, mode="w"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    logging.captureWarnings(True)

    def log_uncaught(kind, value, tb):
        logging.getLogger("eaglepipe").error("%s: %s", kind.__name__, value, exc_info=(kind, value, tb))

    sys.excepthook = log_uncaught
