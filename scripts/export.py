from eaglepipe import jobs

jobs.export(snakemake)
