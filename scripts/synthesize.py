from eaglepipe import gpus, logs, preflight, synthesize

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    logs.to_file(snakemake.log[0])
    gpus.claim(snakemake.resources.gpu)
    s = snakemake.params.synthesize
    preflight.run_job(
        snakemake.config,
        snakemake.input.target,
        output_path=snakemake.output.prompts,
        # Resume units hold every sample's token ids; the kept prompts are smaller.
        needed_bytes=preflight.trace_bytes(s["count"], 0, s["max_new_tokens"]),
        stage_outputs=[snakemake.output.prompts],
        what="synthesized prompts",
        gpus=snakemake.resources.gpu,
    )
    synthesize.run(
        snakemake.output.prompts,
        snakemake.output.counts,
        target_dir=snakemake.input.target,
        engine={**snakemake.params.engine, "threads": snakemake.threads},
        settings=s,
        template_kwargs=snakemake.params.template_kwargs,
        chat_template=snakemake.params.chat_template,
        progress_dir=snakemake.params.progress,
    )
