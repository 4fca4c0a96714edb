"""Data scaling: offline tau against training tokens, by training the same recipe on shares of the train data.

    python -m eaglepipe.tools.scaling --directory /path/to/workdir \
        --configfile config/config.yaml config/examples/h200-quality.yaml \
        --json docs/measured/scaling.json --plot docs/measured/scaling.png

Run it in a finished workflow's directory: it reads the hidden-state shards, the vocab map and the manifest there, and
trains with the config's `train` settings (the same as the train rule) at each share f in --fractions (default 1/8,
1/4, 1/2) of every train shard's sequences (train.data_fraction: a seeded random subset, each smaller share's inside
the larger one's), then evaluates every draft on all eval shards as the evaluate rule does. The full-data point is
the workflow's own results/eval/acceptance.json; a fraction of 1 retrains it (and reproduces it exactly). Drafts go
to --scratch and are removed. Writes one point per share (fraction, conversations, training tokens, tau for
k = 1..max_k, training seconds) and a plot of tau(k) against training tokens (log scale).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from .. import config as eaglepipe_config
from .. import batches, evaluate, train

log = logging.getLogger(__name__)


def load_config(files: list[str]) -> dict:
    merged: dict = {}
    for path in files:
        for key, value in eaglepipe_config.load(path).items():
            merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return eaglepipe_config.validate(merged)


def point(paths: list[str], settings: dict, acceptance: dict, seconds: float | None) -> dict:
    """One curve point: the conversations and tokens the training at settings["data_fraction"] used."""
    cus = [batches.sequence_lengths(p) for p in sorted(paths)]
    kept = train.kept_sequences(cus, settings) or [list(range(cu.numel() - 1)) for cu in cus]
    max_tokens = settings["max_batch_tokens"]
    tokens = sum(int((cu[1:] - cu[:-1]).clamp(max=max_tokens)[k].sum()) for cu, k in zip(cus, kept) if k)
    return {"fraction": settings.get("data_fraction", 1.0), "conversations": sum(map(len, kept)),
            "train_tokens": tokens, "tau": acceptance["tau"], "train_seconds": seconds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=".")
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--fractions", default="0.125,0.25,0.5",
                        help="comma-separated shares of the train sequences, each in (0, 1]")
    parser.add_argument("--scratch", default="/tmp/eaglepipe-scaling")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.configfile)
    work = Path(args.directory)
    manifest = json.loads((work / "results/hidden_states/manifest.json").read_text())
    train_paths = sorted(str(work / s["path"]) for s in manifest["shards"] if s["split"] == "train")
    eval_paths = sorted(str(work / s["path"]) for s in manifest["shards"] if s["split"] == "eval")
    target = cfg["target"]["path"] or str(work / "resources/targets/smollm2-135m")
    fractions = [float(f) for f in args.fractions.split(",")]
    if not all(0 < f <= 1 for f in fractions):
        raise SystemExit(f"--fractions {args.fractions}: each share must be in (0, 1]")
    points = []
    for f in fractions:
        settings = {**cfg["train"], "gpus": 0, "processes": 1, "data_fraction": f}
        out = Path(args.scratch) / f"fraction-{f:g}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.monotonic()
        train.run(train_paths, work / "results/vocab/vocab_map.safetensors", out, target_dir=target,
                  layer_ids=manifest["layer_ids"], settings=settings, threads=cfg["train"]["threads"],
                  progress_dir=out / ".progress")
        seconds = time.monotonic() - start
        e = cfg["evaluate"]  # as the evaluate rule runs it, so a fraction of 1 gives the workflow's own figure
        evaluate.run(eval_paths, out, out / "acceptance.json", target_dir=target, max_k=e["max_k"],
                     max_tokens=e["max_batch_tokens"], threads=e["threads"], device=e["device"])
        points.append(point(train_paths, settings, json.loads((out / "acceptance.json").read_text()), seconds))
        log.info("fraction %g: %s training tokens, tau(3) %.3f", f, points[-1]["train_tokens"],
                 points[-1]["tau"]["3"])
        shutil.rmtree(out, ignore_errors=True)
    full = json.loads((work / "results/eval/acceptance.json").read_text())
    points.append(point(train_paths, cfg["train"], full, None))
    result = {"command": "python -m eaglepipe.tools.scaling " + " ".join(argv or sys.argv[1:]), "train": cfg["train"],
              "points": points}
    for p in points:
        print(f"fraction {p['fraction']:<6g} {p['conversations']:7,d} conversations  {p['train_tokens']:11,d} tokens  "
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
