rule evaluate:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        shards=HIDDEN_SHARDS["eval"],
        manifest=rules.manifest.output.manifest,
        validation=rules.validate_shards.output.validation,
        config=rules.train.output.config,
        model=rules.train.output.model,
        target=target_dir(),
    output:
        "results/eval/acceptance.json",
    params:
        max_k=config["evaluate"]["max_k"],
        max_tokens=config["train"]["max_batch_tokens"],
    threads: config["train"]["threads"]
    log:
        "logs/evaluate.log",
    script:
        "../scripts/evaluate.py"
