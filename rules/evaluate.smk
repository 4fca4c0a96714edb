rule evaluate:
    input:
        shards=HIDDEN_SHARDS["eval"],
        manifest=rules.manifest.output.manifest,
        validation=rules.validate_shards.output.validation,
        config=rules.train.output.config,
        model=rules.train.output.model,
        target=target_dir(),
    output:
        acceptance="results/eval/acceptance.json",
    log:
        "logs/evaluate.log",
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1 if config["evaluate"]["device"].startswith("cuda") else 0,
    params:
        max_k=config["evaluate"]["max_k"],
        max_tokens=config["evaluate"]["max_batch_tokens"],
        device=config["evaluate"]["device"],
        temperatures=config["evaluate"]["temperatures"],
    script:
        "../scripts/evaluate.py"
