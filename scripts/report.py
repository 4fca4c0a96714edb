from eaglepipe import logs, report

logs.to_file(snakemake.log[0])
report.summary(target=snakemake.params.target, output_path=snakemake.output.summary, **dict(snakemake.input.items()))
