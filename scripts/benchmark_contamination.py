from eaglepipe import jobs

jobs.benchmark_contamination(snakemake)
