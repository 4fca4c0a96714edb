rule bench:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        prompts="results/prompts/eval.parquet",
        traces=shards("results/traces/{split}/shard-{i}.parquet", ["eval"]),
        config=rules.train.output.config,
        model=rules.train.output.model,
        acceptance=rules.evaluate.output.acceptance,
        target=target_dir(),
    output:
        served="results/bench/served.json",
    params:
        bench=config["bench"],
        engine=config["engine"],
        template_kwargs=config["generation"]["template_kwargs"],
        chat_template=config["target"]["chat_template"],
        multi_turn=config["generation"]["multi_turn"],
    threads: config["bench"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/bench.log",
    benchmark:
        "benchmarks/bench.tsv"
    script:
        "../scripts/bench.py"
