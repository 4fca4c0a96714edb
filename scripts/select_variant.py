from eaglepipe import jobs

jobs.select_variant(snakemake)
