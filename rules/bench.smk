rule bench:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        prompts="results/prompts/eval.parquet",
        config=rules.train.output.config,
        model=rules.train.output.model,
        acceptance=rules.evaluate.output[0],
        target=target_dir(),
    output:
        "results/bench/served.json",
    params:
        bench=config["bench"],
        engine=config["engine"],
    threads: config["train"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/bench.log",
    benchmark:
        "benchmarks/bench.tsv"
    script:
        "../scripts/bench.py"
