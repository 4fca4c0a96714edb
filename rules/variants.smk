# train.variants: each variant a draft of its own, trained on the same hidden states and scored like the draft (eval
# split and each benchmark set); `variants` compares them in one table and plot. The best by offline tau at k = 3 on
# the eval split becomes results/draft/ (rule train, rules/train.smk).


wildcard_constraints:
    variant="|".join(re.escape(name) for name in VARIANTS) or "(?!)",


rule train_variant:
    input:
        shards=HIDDEN_SHARDS["train"],
        manifest=rules.manifest.output.manifest,
        validation=rules.validate_shards.output.validation,
        vocab=rules.vocab.output.map,
        target=target_dir(),
    output:
        config="results/drafts/{variant}/config.json",
        model="results/drafts/{variant}/model.safetensors",
        log="results/drafts/{variant}/train_log.jsonl",
    log:
        "logs/drafts/{variant}/train.log",
    benchmark:
        "benchmarks/drafts/{variant}/train.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
    params:
        train=lambda wildcards: VARIANTS[wildcards.variant],
    script:
        "../scripts/train.py"


rule evaluate_variant:
    input:
        shards=HIDDEN_SHARDS["eval"],
        manifest=rules.manifest.output.manifest,
        validation=rules.validate_shards.output.validation,
        config=rules.train_variant.output.config,
        model=rules.train_variant.output.model,
        target=target_dir(),
    output:
        acceptance="results/drafts/{variant}/acceptance.json",
    log:
        "logs/drafts/{variant}/evaluate.log",
    # A trained variant is scored before the next one trains: a sweep stopped part-way leaves figures, not
    # only weights, for every variant it trained.
    priority: 1
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


rule benchmark_evaluate_variant:
    input:
        shard=rules.benchmark_hidden_states.output.shard,
        questions=benchmark_questions,
        contamination=rules.benchmark_contamination.output.check,
        config=rules.train_variant.output.config,
        model=rules.train_variant.output.model,
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        acceptance="results/drafts/{variant}/benchmarks/{bench}/acceptance.json",
    log:
        "logs/drafts/{variant}/benchmarks/{bench}/evaluate.log",
    priority: 1
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
        "../scripts/benchmark_evaluate.py"


rule variants:
    input:
        acceptance=expand(rules.evaluate_variant.output.acceptance, variant=VARIANTS),
        train_log=expand(rules.train_variant.output.log, variant=VARIANTS),
        seconds=expand(rules.train_variant.benchmark, variant=VARIANTS),
        benchmarks=expand(
            rules.benchmark_evaluate_variant.output.acceptance,
            variant=VARIANTS,
            bench=list(BENCHMARKS),
        ),
    output:
        table="results/variants/variants.json",
        plot=report(
            "results/report/variants.png",
            caption="../report/variants.rst",
            category="2. Training",
        ),
    log:
        "logs/variants.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        overrides={name: config["train"]["variants"][name] for name in VARIANTS},
    script:
        "../scripts/variants.py"


# The comparison the report reads when there are variants.
VARIANTS_TABLE = [rules.variants.output.table] if VARIANTS else []
