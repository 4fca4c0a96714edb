rule traces:
    input:
        prompts="results/prompts/{split}.parquet",
        target=target_dir(),
        chat_template=chat_template_file(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        shard="results/traces/{split}/shard-{i}.parquet",
    log:
        "logs/traces/{split}/shard-{i}.log",
    benchmark:
        "benchmarks/traces/{split}/shard-{i}.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        engine=settings("engine"),
        generation=config["generation"],
        # Completed chunks for resume after a crash: not an output, so Snakemake keeps it when the job fails.
        progress="results/.progress/traces/{split}/shard-{i}",
        stage=split_shards("results/traces/{split}/shard-{i}.parquet"),
        chat_template=config["target"]["chat_template"],
        reasoning=config["target"]["reasoning"],
    script:
        "../scripts/traces.py"


rule trace_stats:
    input:
        shards=shards("results/traces/{split}/shard-{i}.parquet"),
    output:
        stats="results/traces/stats.json",
    log:
        "logs/trace_stats.log",
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/trace_stats.py"
