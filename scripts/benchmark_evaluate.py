from eaglepipe import jobs

jobs.benchmark_evaluate(snakemake)
