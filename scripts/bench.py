from pathlib import Path

from eaglepipe import bench, gpus, logs

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    logs.to_file(snakemake.log[0])
    gpus.claim(snakemake.resources.gpu)
    b = snakemake.params.bench
    bench.run(
        snakemake.input.prompts,
        Path(snakemake.input.model).parent,
        snakemake.input.acceptance,
        snakemake.output.served,
        target_dir=snakemake.input.target,
        engine={**snakemake.params.engine, "threads": snakemake.threads},
        ks=b["ks"],
        batch_size=b["batch_size"],
        batch1_prompts=b["batch1_prompts"],
        max_prompts=b["max_prompts"],
        max_new_tokens=b["max_new_tokens"],
        tolerance=b["tolerance"],
        template_kwargs=snakemake.params.template_kwargs,
        traces=list(snakemake.input.traces),
        diagnose=b["diagnose"],
        diagnose_prompts=b["diagnose_prompts"],
        chat_template=snakemake.params.chat_template,
        multi_turn=snakemake.params.multi_turn,
    )
