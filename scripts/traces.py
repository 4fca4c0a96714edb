from eaglepipe import gpus, logs, preflight, traces

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    logs.to_file(snakemake.log[0])
    gpus.claim(snakemake.resources.gpu)
    g = snakemake.params.generation
    shard = int(snakemake.wildcards.i)
    preflight.run_job(
        snakemake.config,
        snakemake.input.target,
        output_path=snakemake.output.shard,
        needed_bytes=preflight.traces_estimate(snakemake.input.prompts, shard, g["num_shards"], g["max_new_tokens"]),
        stage_outputs=snakemake.params.stage,
        what="trace shards",
        gpus=snakemake.resources.gpu,
    )
    traces.run(
        snakemake.input.prompts,
        snakemake.output.shard,
        target_dir=snakemake.input.target,
        split=snakemake.wildcards.split,
        shard=shard,
        num_shards=g["num_shards"],
        engine={**snakemake.params.engine, "threads": snakemake.threads},
        sampling={k: g[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")},
        template_kwargs=g["template_kwargs"],
        chunk_size=g["chunk_size"],
        max_error_share=g["max_error_share"],
        chat_template=snakemake.params.chat_template,
        reasoning_markers=snakemake.params.reasoning,
        multi_turn=g["multi_turn"],
        progress_dir=snakemake.params.progress,
    )
