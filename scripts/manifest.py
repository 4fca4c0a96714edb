from eaglepipe import hidden_states, logs

logs.to_file(snakemake.log[0])
hidden_states.manifest(
    snakemake.params.shards,
    {"train": list(snakemake.input.train), "eval": list(snakemake.input.eval)},
    snakemake.output.manifest,
    target_dir=snakemake.input.target,
    engine=snakemake.params.engine,
)
