"""Training on CUDA is reproducible: a tiny DeepSeek-V3 with Kimi-K2's yarn rope, the workflow to its draft with the
transformers engine and training on CUDA; the draft's bytes again when training is forced to run again, and when a
training SIGKILLed after a checkpoint resumes from it."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

import tiny_targets
from conftest import REPO, snakemake

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DRAFT = "results/draft/model.safetensors"
CONFIG = {
    "target": {"name": "tiny-kimi-rope"},
    "engine": {"name": "transformers", "device": "cuda", "dtype": "bfloat16", "batch_size": 32, "gpus": 1},
    "prompts": {"max_prompts": 160},
    "generation": {"max_new_tokens": 64, "num_shards": 2, "chunk_size": 16},
    "vocab": {"draft_vocab_size": 4096},
    "train": {"device": "cuda", "gpus": 1, "epochs": 6, "ttt_steps": 3, "checkpoint_every": 10, "log_every": 10},
}


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """The workflow directory with its first draft, the config, and the draft's sha256."""
    root = tmp_path_factory.mktemp("gpu-yarn")
    target = tiny_targets.kimi_rope(root / "target", smollm2)
    config = {**CONFIG, "target": {**CONFIG["target"], "path": str(target)}}
    workdir = root / "work"
    snakemake(workdir, config, DRAFT)
    return workdir, config, sha256(workdir / DRAFT)


def test_training_forced_again_on_cuda_gives_the_same_draft_bytes(trained):
    workdir, config, first = trained
    snakemake(workdir, config, "--forcerun", "train", DRAFT)
    assert sha256(workdir / DRAFT) == first


def test_a_training_killed_after_a_checkpoint_resumes_to_the_same_draft_bytes(trained):
    workdir, config, first = trained
    progress = workdir / "results/draft/.progress/checkpoint.pt"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2",
           "--forcerun", "train", DRAFT, "--configfile", str(REPO / "config/config.yaml"),
           str(workdir / "test-config.yaml")]
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not progress.is_file() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGKILL)  # Snakemake and the training job with it, as a lost machine would
    run.wait()
    assert progress.is_file(), "training wrote no checkpoint before it ended: nothing to resume from"
    assert not (workdir / DRAFT).exists(), "training finished before the kill: the resume is not exercised"
    snakemake(workdir, config, "--unlock")
    snakemake(workdir, config, "--rerun-incomplete", DRAFT)
    assert "resuming from the checkpoint at step" in (workdir / "logs/train.log").read_text()
    assert sha256(workdir / DRAFT) == first
