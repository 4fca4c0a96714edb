from eaglepipe import jobs

jobs.validate_shards(snakemake)
