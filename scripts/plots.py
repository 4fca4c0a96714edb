from eaglepipe import jobs

jobs.plots(snakemake)
