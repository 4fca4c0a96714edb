rule bench:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        # prompts, traces, config, model, acceptance: the workflow's own or a draft bundle's (bench.draft)
        unpack(bench_inputs()),
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        served="results/bench/served.json",
        serving="results/serve/vllm.json",
    params:
        bench=settings("bench"),
        engine=settings("engine"),
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
