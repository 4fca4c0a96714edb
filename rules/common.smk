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


def check_config_against_target():
    """Config that cannot fit the target (layer ids beyond its depth, a draft vocabulary larger than its own) fails
    here, before any job, whenever the target's config.json is already there (jobs check again: eaglepipe.preflight)."""
    path = config["target"]["path"] or EMBEDDED_TARGET
    if not config["preflight"]["enabled"] or not os.path.isfile(os.path.join(path, "config.json")):
        return
    import eaglepipe.preflight  # here: it imports torch, which runs without a target need not wait for
    import eaglepipe.target

    try:
        eaglepipe.preflight.check_config(config, eaglepipe.target.read_info(path))
    except (ValueError, eaglepipe.preflight.PreflightError) as err:
        raise WorkflowError(f"{err}\n(target {path})") from None


check_config_against_target()

for source in config["prompts"]["sources"]:
    if not os.path.isfile(source):
        raise WorkflowError(f"config key prompts.sources: {source!r} does not exist; fix the path or remove it")


def shards(pattern, splits=SPLITS):
    return expand(pattern, split=splits, i=SHARDS)
