import os

from snakemake.exceptions import WorkflowError

import eaglepipe.config

try:
    eaglepipe.config.validate(config, workflow.source_path("../config/schema.yaml"))
except eaglepipe.config.ConfigError as err:
    raise WorkflowError(str(err)) from None

EMBEDDED_TARGET = "resources/targets/smollm2-135m"
SPLITS = ["train", "eval"]
SHARDS = list(range(config["generation"]["num_shards"]))


wildcard_constraints:
    split="train|eval",
    i=r"\d+",


def target_dir():
    """The target checkpoint: a user's local folder (never rebuilt) or the embedded default."""
    path = config["target"]["path"]
    if path is None:
        return EMBEDDED_TARGET
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise WorkflowError(
            f"config key target.path: {path!r} is not a checkpoint folder (no config.json there); "
            "point it at a local Hugging Face checkpoint or set it to null for the embedded default"
        )
    return ancient(path)


def shards(pattern, splits=SPLITS):
    return expand(pattern, split=splits, i=SHARDS)
