from eaglepipe import jobs

jobs.evaluate(snakemake)
