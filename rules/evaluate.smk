rule evaluate:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        shards=rules.manifest.input.eval,
        validation=rules.validate_shards.output[0],
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
