from eaglepipe import logs, traces

logs.to_file(snakemake.log[0])
traces.stats(list(snakemake.input.shards), snakemake.output.stats)
