from eaglepipe import gpus, hidden_states, logs, preflight
from eaglepipe.target import read_info

# The guard keeps vLLM's spawned processes from re-running the job when they import this script.
if __name__ == "__main__":
    logs.to_file(snakemake.log[0])
    gpus.claim(snakemake.resources.gpu)
    h = snakemake.params.hidden_states
    preflight.run_job(
        snakemake.config,
        snakemake.input.target,
        output_path=snakemake.output.shard,
        needed_bytes=preflight.hidden_states_estimate(snakemake.input.traces, h["max_length"],
                                                      read_info(snakemake.input.target).hidden_size),
        stage_outputs=snakemake.params.stage,
        what="hidden-state shards",
        gpus=snakemake.resources.gpu,
    )
    hidden_states.run(
        snakemake.input.traces,
        snakemake.output.shard,
        target_dir=snakemake.input.target,
        layer_ids=h["aux_layer_ids"],
        engine={**snakemake.params.engine, "threads": snakemake.threads},
        max_length=h["max_length"],
        chunk_size=h["chunk_size"],
        progress_dir=snakemake.params.progress,
        record_path=snakemake.output.record,
    )
