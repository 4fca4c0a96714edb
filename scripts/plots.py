from eaglepipe import logs, plots

logs.to_file(snakemake.log[0])
plots.run(
    coverage_path=snakemake.input.coverage,
    train_log=snakemake.input.train_log,
    acceptance_path=snakemake.input.acceptance,
    served_path=snakemake.input.served,
    outputs=dict(snakemake.output.items()),
)
