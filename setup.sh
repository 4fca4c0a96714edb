#!/usr/bin/env bash
# Creates .venv with eaglepipe and its pinned dependencies (CPU build of torch). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade "pip>=24"
# The CPU build of torch first: on a GPU machine install the CUDA build of the same version instead.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
