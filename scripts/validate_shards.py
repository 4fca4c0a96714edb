from pathlib import Path

from eaglepipe import logs, validate

logs.to_file(snakemake.log[0])
validate.run(
    snakemake.input.manifest,
    {f"{Path(p).parent.name}/{Path(p).stem}": p for p in snakemake.input.traces},
    snakemake.output.validation,
    max_length=snakemake.params.max_length,
)
