rule train:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        shards=HIDDEN_SHARDS["train"],
        manifest=rules.manifest.output.manifest,
        validation=rules.validate_shards.output.validation,
        vocab=rules.vocab.output.map,
        target=target_dir(),
    output:
        config="results/draft/config.json",
        model="results/draft/model.safetensors",
        log="results/draft/train_log.jsonl",
    params:
        train=settings("train"),
    threads: config["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    script:
        "../scripts/train.py"
