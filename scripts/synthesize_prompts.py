from eaglepipe import jobs

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    jobs.synthesize_prompts(snakemake)
