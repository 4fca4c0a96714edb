from eaglepipe import jobs

jobs.target_fingerprint(snakemake)
