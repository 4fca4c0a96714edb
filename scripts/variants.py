from eaglepipe import jobs

jobs.variants(snakemake)
