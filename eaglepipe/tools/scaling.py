"""Data scaling: offline tau against training tokens, by training the same recipe on 1, 2, 4, ... of the train shards.

    python -m eaglepipe.tools.scaling --directory /path/to/workdir \
        --configfile config/config.yaml config/examples/h200-quality.yaml \
        --json docs/measured/scaling.json --plot docs/measured/scaling.png

Run it in a finished workflow's directory: it reads the hidden-state shards, the vocab map and the manifest there, and
trains with the config's `train` settings (the same as the train rule) on the first n train shards (shards are
partitioned by a hash of the prompt id, so each prefix is a random subset of conversations), for each n in --shards
(default: powers of two below the shard count), then evaluates every draft on all eval shards as the evaluate rule does.
The full-data point is the workflow's own results/eval/acceptance.json. Drafts go to --scratch and are removed.
Writes one point per n (shards, conversations, training tokens, tau for k = 1..max_k) and a plot of tau(k) against
training tokens (log scale).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import yaml

from .. import config as eaglepipe_config
from .. import evaluate, train

log = logging.getLogger(__name__)


def load_config(files: list[str]) -> dict:
    merged: dict = {}
    for path in files:
        for key, value in (yaml.safe_load(Path(path).read_text()) or {}).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return eaglepipe_config.validate(merged)


def point(manifest: dict, paths: list[str], acceptance: dict, seconds: float | None) -> dict:
    rows = {s["path"]: s for s in manifest["shards"]}
    return {"shards": len(paths), "conversations": sum(rows[p]["samples"] for p in paths),
            "train_tokens": sum(rows[p]["tokens"] for p in paths),
            "loss_tokens": sum(rows[p]["loss_tokens"] for p in paths),
            "tau": acceptance["tau"], "train_seconds": seconds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=".")
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--shards", help="comma-separated shard counts (default: 1, 2, 4, ... below the total)")
    parser.add_argument("--scratch", default="/tmp/eaglepipe-scaling")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.configfile)
    work = Path(args.directory)
    manifest = json.loads((work / "results/hidden_states/manifest.json").read_text())
    train_paths = sorted(s["path"] for s in manifest["shards"] if s["split"] == "train")
    eval_paths = sorted(str(work / s["path"]) for s in manifest["shards"] if s["split"] == "eval")
    target = cfg["target"]["path"] or str(work / "resources/targets/smollm2-135m")
    counts = ([int(n) for n in args.shards.split(",")] if args.shards
              else [2**i for i in range(len(train_paths).bit_length()) if 2**i < len(train_paths)])
    settings = {**cfg["train"], "gpus": 0, "processes": 1}
    points = []
    for n in counts:
        out = Path(args.scratch) / f"shards-{n}"
        shutil.rmtree(out, ignore_errors=True)
        paths = train_paths[:n]
        start = time.monotonic()
        train.run([str(work / p) for p in paths], work / "results/vocab/vocab_map.safetensors", out,
                  target_dir=target, layer_ids=manifest["layer_ids"], settings=settings,
                  threads=cfg["train"]["threads"], progress_dir=out / ".progress")
        seconds = time.monotonic() - start
        e = cfg["evaluate"]  # as the evaluate rule runs it, so the all-shards point is the workflow's own figure
        evaluate.run(eval_paths, out, out / "acceptance.json", target_dir=target, max_k=e["max_k"],
                     max_tokens=e["max_batch_tokens"], threads=e["threads"], device=e["device"])
        points.append(point(manifest, paths, json.loads((out / "acceptance.json").read_text()), seconds))
        log.info("%d shards: %s training tokens, tau(3) %.3f", n, points[-1]["train_tokens"], points[-1]["tau"]["3"])
        shutil.rmtree(out, ignore_errors=True)
    full = json.loads((work / "results/eval/acceptance.json").read_text())
    points.append(point(manifest, train_paths, full, None))
    result = {"command": "python -m eaglepipe.tools.scaling " + " ".join(argv or sys.argv[1:]), "train": cfg["train"],
              "points": points}
    for p in points:
        print(f"{p['shards']:3d} shards  {p['conversations']:7,d} conversations  {p['train_tokens']:11,d} tokens  "
              f"tau(3) {p['tau']['3']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if args.plot:
        plot(points, args.plot)
    return result


def plot(points: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [p["train_tokens"] for p in points]
    for k in ("1", "3", "5"):
        if k in points[0]["tau"]:
            ax.plot(tokens, [p["tau"][k] for p in points], marker="o", label=f"tau({k})")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (unique, before epochs)")
    ax.set_ylabel("offline tau (tokens per target pass)")
    ax.set_title("Data scaling: offline acceptance on held-out prompts")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


if __name__ == "__main__":
    main()
