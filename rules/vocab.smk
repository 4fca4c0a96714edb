rule vocab:
    input:
        traces=shards("results/traces/{split}/shard-{i}.parquet", ["train"]),
        target=target_dir(),
    output:
        map="results/vocab/vocab_map.safetensors",
        coverage="results/vocab/coverage.json",
    log:
        "logs/vocab.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        vocab=config["vocab"],
    script:
        "../scripts/vocab.py"
