from eaglepipe import jobs

jobs.prompts(snakemake)
