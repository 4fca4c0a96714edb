from pathlib import Path

from eaglepipe import evaluate, logs, validate

logs.to_file(snakemake.log[0])
validate.verify_shards(snakemake.input.manifest, snakemake.input.shards)
evaluate.run(
    list(snakemake.input.shards),
    Path(snakemake.input.model).parent,
    snakemake.output.acceptance,
    target_dir=snakemake.input.target,
    max_k=snakemake.params.max_k,
    max_tokens=snakemake.params.max_tokens,
    threads=snakemake.threads,
)
