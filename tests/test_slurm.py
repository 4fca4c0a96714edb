"""The tiny-target workflow submitted through profiles/slurm to a real single-node SLURM cluster (sbatch jobs)."""

import re
import subprocess
import sys
import time

import pytest

import slurm_cluster
from conftest import REPO, tiny_config

reason = slurm_cluster.missing()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(reason is not None, reason=reason or "")]


def test_workflow_runs_to_completion_through_slurm_jobs(tmp_path, tiny_target):
    import yaml

    workdir = tmp_path / "work"
    workdir.mkdir()
    # One shard per split keeps the job count (10) and CI time down; every stage up to offline acceptance runs.
    # Training declares the test node's 2 GPUs: SLURM schedules them (gres/gpu) and the job runs as one task that
    # starts 2 training processes (gloo on CPU, as there are no real devices).
    cfg = tiny_config(tiny_target, generation={"num_shards": 1}, train={"gpus": slurm_cluster.GPUS})
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(cfg))
    target = "results/eval/acceptance.json"
    start = time.monotonic()
    with slurm_cluster.cluster(tmp_path / "cluster") as env:
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
             "--workflow-profile", str(REPO / "profiles/slurm"),
             # The test cluster has no accounting database: squeue for status (MinJobAge=300), no account to guess.
             "--slurm-status-command", "squeue", "--slurm-no-account", "--slurm-init-seconds-before-status-checks", "2",
             target, "--configfile", str(REPO / "config/config.yaml"), str(workdir / "test-config.yaml")],
            env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - start
        # Finished jobs stay in the controller for MinJobAge (300 s): their resources as SLURM allocated them.
        shown = subprocess.run(["scontrol", "show", "job", "-o"], env=env, capture_output=True, text=True).stdout
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    submitted = dict(re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: \S*/rule_(\w+)/", out))
    records = {r["id"]: r for r in slurm_cluster.job_records(tmp_path / "cluster")}
    print(f"\nSLURM run: {len(submitted)} sbatch jobs in {elapsed:.0f} s; job records (jobcomp/filetxt):")
    for job, rule in sorted(submitted.items(), key=lambda kv: int(kv[0])):
        print(f"  job {job} rule {rule}: {records.get(job)}")
    rules = set(submitted.values())
    assert {"prompts", "traces", "hidden_states", "vocab", "manifest", "validate_shards", "train",
            "evaluate"} <= rules, rules
    for job in submitted:  # every job the executor submitted ran on the cluster and ended well
        assert job in records, f"SLURM job {job} has no record in the controller's completion file"
        assert records[job]["state"] == "COMPLETED" and records[job]["exit"] == "0:0", records[job]
    train_job = next(job for job, rule in submitted.items() if rule == "train")
    train_shown = next(line for line in shown.splitlines() if line.startswith(f"JobId={train_job} "))
    print("  train job as scontrol shows it:",
          " ".join(re.findall(r"(?:NumTasks|TresPerJob|AllocTRES)=\S+", train_shown)))
    assert f"TresPerJob=gres:gpu:{slurm_cluster.GPUS}" in train_shown and "NumTasks=1 " in train_shown, train_shown
    log = (workdir / "logs/train.log").read_text()
    # One task: the rule ran once, and its one torchrun started both ranks, which ended with the same weights.
    assert log.count("launching ") == 1 and "SLURM job " in log, log[-3000:]
    hashes = re.findall(r"rank (\d) of 2: final weights sha256 (\w+)", log)
    assert sorted(r for r, _ in hashes) == ["0", "1"] and len({h for _, h in hashes}) == 1, hashes
    assert (workdir / target).is_file()
