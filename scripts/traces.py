from eaglepipe import gpus, logs, traces

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    logs.to_file(snakemake.log[0])
    gpus.claim(snakemake.resources.gpu)
    g = snakemake.params.generation
    traces.run(
        snakemake.input.prompts,
        snakemake.output[0],
        target_dir=snakemake.input.target,
        split=snakemake.wildcards.split,
        shard=int(snakemake.wildcards.i),
        num_shards=g["num_shards"],
        engine={**snakemake.params.engine, "threads": snakemake.threads},
        sampling={k: g[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")},
        template_kwargs=g["template_kwargs"],
        chunk_size=g["chunk_size"],
        max_error_share=g["max_error_share"],
        chat_template=snakemake.params.chat_template,
        reasoning_markers=snakemake.params.reasoning,
        multi_turn=g["multi_turn"],
    )
