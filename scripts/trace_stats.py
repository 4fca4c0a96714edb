from eaglepipe import jobs

jobs.trace_stats(snakemake)
