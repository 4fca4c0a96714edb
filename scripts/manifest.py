from eaglepipe import jobs

jobs.manifest(snakemake)
