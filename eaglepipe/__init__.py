"""eaglepipe: EAGLE-3 draft training as a reproducible Snakemake pipeline."""
