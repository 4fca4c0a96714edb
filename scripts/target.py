from eaglepipe import jobs

jobs.target(snakemake)
