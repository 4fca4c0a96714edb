rule hidden_states:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        traces="results/traces/{split}/shard-{i}.parquet",
        target=target_dir(),
    output:
        "results/hidden_states/{split}/shard-{i}.safetensors",
    params:
        engine=config["engine"],
        hidden_states=config["hidden_states"],
        # Completed chunks for resume after a crash: not an output, so Snakemake keeps it when the job fails.
        progress="results/.progress/hidden_states/{split}/shard-{i}",
        stage=shards("results/hidden_states/{split}/shard-{i}.safetensors"),
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/hidden_states/{split}/shard-{i}.log",
    benchmark:
        "benchmarks/hidden_states/{split}/shard-{i}.tsv"
    script:
        "../scripts/hidden_states.py"


rule manifest:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        train=shards("results/hidden_states/{split}/shard-{i}.safetensors", ["train"]),
        eval=shards("results/hidden_states/{split}/shard-{i}.safetensors", ["eval"]),
        target=target_dir(),
    output:
        "results/hidden_states/manifest.json",
    params:
        engine=config["engine"]["name"],
    log:
        "logs/manifest.log",
    script:
        "../scripts/manifest.py"


rule validate_shards:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        manifest=rules.manifest.output[0],
        shards=rules.manifest.input.train + rules.manifest.input.eval,
        traces=shards("results/traces/{split}/shard-{i}.parquet"),
    output:
        "results/hidden_states/validation.json",
    params:
        max_length=config["hidden_states"]["max_length"],
    log:
        "logs/validate_shards.log",
    script:
        "../scripts/validate_shards.py"
