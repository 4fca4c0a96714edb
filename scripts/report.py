from eaglepipe import jobs

jobs.report(snakemake)
