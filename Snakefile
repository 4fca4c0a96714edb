# eaglepipe: raw prompts -> traces -> vocab map -> hidden states -> EAGLE-3 draft -> offline acceptance -> report.
import os

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

import eaglepipe.config

min_version("9.0")


# The shipped defaults, found from the Snakefile so that --directory elsewhere works; --configfile overrides.
# Checked first: Snakemake's message for a file that does not parse names neither the file nor the line.
try:
    eaglepipe.config.load(os.path.join(workflow.basedir, "config", "config.yaml"))
except eaglepipe.config.ConfigError as err:
    raise WorkflowError(str(err)) from None


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


# `snakemake --report report.html`: this text on the front page, the plots rule's figures with their captions.
report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/traces.smk"
include: "rules/vocab.smk"
include: "rules/hidden_states.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/benchmarks.smk"
include: "rules/bench.smk"
include: "rules/variants.smk"
include: "rules/export.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output.summary,
        rules.export.output.checks,
        rules.plots.output,
