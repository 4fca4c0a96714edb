from eaglepipe import jobs

jobs.benchmark_prompts(snakemake)
