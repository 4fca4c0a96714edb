if not VARIANTS:

    rule train:
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
        log:
            "logs/train.log",
        benchmark:
            "benchmarks/train.tsv"
        conda:
            "../envs/eaglepipe.yaml"
        threads: config["train"]["threads"]
        resources:
            gpu=config["train"]["gpus"],
        params:
            train=settings("train"),
        script:
            "../scripts/train.py"

else:

    # With train.variants the draft is the variant with the best offline tau at k = 3 on the eval split, copied
    # (rules/variants.smk trains and scores them; input functions, as those rules are defined further on).
    rule train:
        input:
            acceptance=lambda wildcards: expand(rules.evaluate_variant.output.acceptance, variant=VARIANTS),
            config=lambda wildcards: expand(rules.train_variant.output.config, variant=VARIANTS),
            model=lambda wildcards: expand(rules.train_variant.output.model, variant=VARIANTS),
            train_log=lambda wildcards: expand(rules.train_variant.output.log, variant=VARIANTS),
        output:
            config="results/draft/config.json",
            model="results/draft/model.safetensors",
            log="results/draft/train_log.jsonl",
        log:
            "logs/train.log",
        conda:
            "../envs/eaglepipe.yaml"
        params:
            variants=list(VARIANTS),
        script:
            "../scripts/select_variant.py"
