"""Training at scale on CPU: two gloo processes under torchrun against one process, and resume after SIGKILL."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, snakemake, tiny_config
from eaglepipe import config as config_mod
from eaglepipe import train

# float32 weights of 2 ranks vs 1 process after the same global batches: only the summation order differs.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_target):
    """A tiny-target workdir with validated hidden-state shards and the vocab map: everything training needs."""
    workdir = tmp_path_factory.mktemp("upstream")
    snakemake(workdir, tiny_config(tiny_target), "results/hidden_states/validation.json",
              "results/vocab/vocab_map.safetensors")
    return workdir


def run_kwargs(workdir: Path, target: Path, out: Path, **train_settings) -> dict:
    cfg = tiny_config(target, train=train_settings)
    config_mod.validate(cfg)
    manifest = workdir / "results/hidden_states/manifest.json"
    return dict(shard_paths=sorted(map(str, (workdir / "results/hidden_states/train").glob("*.safetensors"))),
                vocab_path=str(workdir / "results/vocab/vocab_map.safetensors"), out_dir=str(out),
                target_dir=str(target), layer_ids=json.loads(manifest.read_text())["layer_ids"],
                settings=cfg["train"], threads=1, key_files=[str(manifest)], weights_out=str(out / "weights"))


def test_two_gloo_processes_agree_and_match_one_process(upstream, tiny_target, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train.run(**run_kwargs(upstream, tiny_target, one, epochs=8))
    args = tmp_path / "two.json"
    args.write_text(json.dumps(run_kwargs(upstream, tiny_target, two, epochs=8, processes=2)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "eaglepipe.train", str(args)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    hashes = dict(re.findall(r"rank (\d) of 2: final weights sha256 (\w+)", result.stderr))
    assert set(hashes) == {"0", "1"} and hashes["0"] == hashes["1"], hashes
    ranks = [torch.load(two / "weights" / f"rank-{r}.pt") for r in (0, 1)]
    single = torch.load(one / "weights" / "rank-0.pt")
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in single)
    diff = max(float((ranks[0][k].float() - single[k].float()).abs().max()) for k in single)
    print(f"max abs weight difference, 2 gloo processes vs 1 process: {diff:.3g}")
    assert diff < TOLERANCE
    # The same schedule and global batches: the logs agree on steps, tokens and learning rates, losses closely.
    logs = [[json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()] for d in (one, two)]
    assert [(r["step"], r["tokens"], r["lr"]) for r in logs[0]] == [(r["step"], r["tokens"], r["lr"]) for r in logs[1]]
    assert max(abs(a - b) for r1, r2 in zip(*logs) for a, b in zip(r1["loss"], r2["loss"])) < 1e-3
    assert not (two / ".progress").exists() and not (one / ".progress").exists()


def test_bf16_autocast_trains_like_fp32(upstream, tiny_target, tmp_path):
    """train.precision bf16 takes the same steps over the same batches with bfloat16 products: the weights differ
    (the autocast is in effect), the losses stay close to float32's."""
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    train.run(**run_kwargs(upstream, tiny_target, fp32, epochs=4))
    train.run(**run_kwargs(upstream, tiny_target, bf16, epochs=4, precision="bf16"))
    logs = [[json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()] for d in (fp32, bf16)]
    assert [(r["step"], r["tokens"]) for r in logs[0]] == [(r["step"], r["tokens"]) for r in logs[1]]
    gaps = [abs(a - b) / a for r1, r2 in zip(*logs) for a, b in zip(r1["loss"], r2["loss"])]
    print(f"bf16 vs fp32 training loss: largest relative gap {max(gaps):.2e} over {len(gaps)} values")
    assert max(gaps) < 0.02
    weights = [torch.load(d / "weights" / "rank-0.pt") for d in (fp32, bf16)]
    assert all(weights[1][k].dtype == weights[0][k].dtype for k in weights[0])  # float32 master weights in both
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0] if weights[0][k].is_floating_point())


def draft_processes(workdir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(workdir) in part for part in proc.info["cmdline"] or []) and "eaglepipe.train" in " ".join(
                    proc.info["cmdline"]):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("processes", [1, 2])
def test_training_resumes_after_sigkill_with_identical_outputs(upstream, tiny_target, tmp_path, processes):
    cfg = tiny_config(tiny_target, train={"epochs": 30, "checkpoint_every": 10, "processes": processes})
    full, killed = tmp_path / "full", tmp_path / "killed"
    for workdir in (full, killed):
        shutil.copytree(upstream, workdir, symlinks=True)
    outputs = ["results/draft/model.safetensors", "results/draft/train_log.jsonl"]
    snakemake(full, cfg, outputs[0])

    (killed / "test-config.yaml").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(killed), "--cores", "2",
           outputs[0], "--configfile", str(REPO / "config" / "config.yaml"), str(killed / "test-config.yaml")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = killed / "results/draft/.progress/checkpoint.pt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert proc.poll() is None, "snakemake ended before training wrote a checkpoint"
        assert time.monotonic() < deadline, "no training checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)  # ranks of torchrun sit in their own sessions and die with their parent, not with the group
    assert draft_processes(killed) == [], "training processes survived the kill"
    assert not (killed / outputs[0]).exists(), "training finished before the kill; the test proves nothing"

    snakemake(killed, cfg, "--unlock")
    snakemake(killed, cfg, outputs[0], "--rerun-incomplete")
    log = (killed / "logs/train.log").read_text()
    resumed = re.search(r"resuming from the checkpoint at step (\d+) of (\d+)", log)
    assert resumed and 0 < int(resumed[1]) < int(resumed[2]), log[-3000:]
    for name in outputs:
        assert (killed / name).read_bytes() == (full / name).read_bytes(), f"{name} differs from the uninterrupted run"
    assert not (killed / "results/draft/.progress").exists()
