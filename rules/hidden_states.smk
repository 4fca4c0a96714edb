rule hidden_states:
    input:
        traces="results/traces/{split}/shard-{i}.parquet",
        target=target_dir(),
    output:
        "results/hidden_states/{split}/shard-{i}.safetensors",
    params:
        engine=config["engine"],
        hidden_states=config["hidden_states"],
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
