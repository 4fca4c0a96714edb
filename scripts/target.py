from eaglepipe import logs, target

logs.to_file(snakemake.log[0])
target.fetch_embedded(snakemake.output.target)
