from eaglepipe import jobs

jobs.vocab(snakemake)
