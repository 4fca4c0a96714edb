"""Which jobs would run side by side on one node: the jobs of a Snakemake dry run, with their threads and GPUs,
packed into waves the way the local scheduler admits them under `--cores C --resources gpu=G`.

Usage: python -m eaglepipe.tools.waves --gpus 8 --cores 64 [snakemake arguments, e.g. --configfile config/x.yaml]
A wave is the set of jobs running at once when every job of the previous wave has finished: a job enters the first
wave after all its inputs' jobs, in job-id order, if its GPUs and threads still fit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    jobid: int
    rule: str
    wildcards: str = ""
    threads: int = 1
    gpus: int = 0
    deps: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.rule}[{self.wildcards}]" if self.wildcards else self.rule


def parse_dry_run(text: str) -> dict[int, Job]:
    """Jobs of `snakemake --dry-run` output: rule, jobid, wildcards, threads and the `gpu` resource."""
    jobs, current = {}, None
    for line in text.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            current = {"rule": m[1]}
        elif current is not None and (m := re.match(r"^\s+(jobid|wildcards|threads|resources): (.*)$", line)):
            current[m[1]] = m[2]
            if m[1] == "jobid":
                jobs[int(m[2])] = current
    out = {}
    for jobid, info in jobs.items():
        resources = dict(kv.split("=", 1) for kv in info.get("resources", "").split(", ") if "=" in kv)
        out[jobid] = Job(jobid, info["rule"], info.get("wildcards", ""), int(info.get("threads", 1)),
                         int(resources.get("gpu", 0)))
    return out


def add_edges(jobs: dict[int, Job], d3dag: dict) -> None:
    """Dependencies from `snakemake --d3dag` (edge u -> v: v needs u's output), among the jobs that will run."""
    for edge in d3dag["edges"]:
        if edge["u"] in jobs and edge["v"] in jobs:
            jobs[edge["v"]].deps.add(edge["u"])


def waves(jobs: dict[int, Job], gpus: int, cores: int) -> list[list[Job]]:
    for job in jobs.values():
        if job.gpus > gpus:
            raise ValueError(f"job {job.name} declares gpu={job.gpus}, more than the node's {gpus}: it would never "
                             "start; lower its gpus setting or plan for a larger node")
    done: set[int] = set()
    result = []
    while len(done) < len(jobs):
        ready = sorted((j for j in jobs.values() if j.jobid not in done and j.deps <= done), key=lambda j: j.jobid)
        if not ready:
            raise ValueError("the dry run's jobs form a cycle or depend on jobs that are not listed")
        wave, free_gpus, free_cores = [], gpus, cores
        for job in ready:
            threads = min(job.threads, cores)  # Snakemake scales a job's threads down to --cores
            if job.gpus <= free_gpus and threads <= free_cores:
                wave.append(job)
                free_gpus -= job.gpus
                free_cores -= threads
        result.append(wave)
        done |= {j.jobid for j in wave}
    return result


def snakemake_jobs(args: list[str], cores: int) -> dict[int, Job]:
    """Run the dry run and the DAG export of this workflow with `args` and return the jobs that would run."""
    base = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", str(cores), *args]
    dry = subprocess.run(base + ["--dry-run"], capture_output=True, text=True)
    if dry.returncode != 0:
        raise RuntimeError(f"snakemake --dry-run failed:\n{dry.stdout[-2000:]}{dry.stderr[-3000:]}")
    dag = subprocess.run(base + ["--d3dag"], capture_output=True, text=True)
    if dag.returncode != 0:
        raise RuntimeError(f"snakemake --d3dag failed:\n{dag.stderr[-3000:]}")
    jobs = parse_dry_run(dry.stdout + dry.stderr)
    add_edges(jobs, json.loads(dag.stdout[dag.stdout.index("{"):]))
    return jobs


def render(plan: list[list[Job]], gpus: int, cores: int) -> str:
    lines = [f"{sum(map(len, plan))} jobs in {len(plan)} waves on a node with {gpus} GPUs and {cores} cores:"]
    for i, wave in enumerate(plan, 1):
        used_gpus, used_cores = sum(j.gpus for j in wave), sum(min(j.threads, cores) for j in wave)
        lines.append(f"wave {i}: {len(wave)} jobs, {used_gpus}/{gpus} GPUs, {used_cores}/{cores} cores")
        for job in wave:
            lines.append(f"  {job.name}  gpu={job.gpus} threads={job.threads}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the node (default 8)")
    parser.add_argument("--cores", type=int, default=64, help="CPU cores of the node (default 64)")
    args, rest = parser.parse_known_args(argv)
    jobs = snakemake_jobs(rest, args.cores)
    print(render(waves(jobs, args.gpus, args.cores), args.gpus, args.cores))


if __name__ == "__main__":
    main()
