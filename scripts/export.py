from pathlib import Path

from eaglepipe import export, logs

logs.to_file(snakemake.log[0])
export.run(
    Path(snakemake.input.model).parent,
    snakemake.input.manifest,
    snakemake.input.target,
    Path(snakemake.output.sglang_config).parent,
    snakemake.output.checks,
    serving_context=snakemake.params.serving_context,
    max_model_len=snakemake.params.max_model_len,
)
