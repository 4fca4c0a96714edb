from eaglepipe import jobs

jobs.train(snakemake)
