rule vocab:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        traces=shards("results/traces/{split}/shard-{i}.parquet", ["train"]),
        target=target_dir(),
    output:
        map="results/vocab/vocab_map.safetensors",
        coverage="results/vocab/coverage.json",
    params:
        vocab=config["vocab"],
    log:
        "logs/vocab.log",
    script:
        "../scripts/vocab.py"
