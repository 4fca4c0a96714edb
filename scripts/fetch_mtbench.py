from eaglepipe import jobs

jobs.fetch_mtbench(snakemake)
