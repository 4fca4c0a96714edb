from eaglepipe import hidden_states, logs

logs.to_file(snakemake.log[0])
h = snakemake.params.hidden_states
hidden_states.run(
    snakemake.input.traces,
    snakemake.output[0],
    target_dir=snakemake.input.target,
    layer_ids=h["aux_layer_ids"],
    engine={**snakemake.params.engine, "threads": snakemake.threads},
    max_length=h["max_length"],
    chunk_size=h["chunk_size"],
)
