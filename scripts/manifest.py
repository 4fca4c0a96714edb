from eaglepipe import hidden_states, logs

logs.to_file(snakemake.log[0])
hidden_states.manifest(
    {"train": list(snakemake.input.train), "eval": list(snakemake.input.eval)},
    snakemake.output[0],
    target_dir=snakemake.input.target,
    engine=snakemake.params.engine,
)
