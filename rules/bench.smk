rule bench:
    input:
        # prompts, traces, config, model, acceptance: the workflow's own or a draft bundle's (bench.draft)
        unpack(bench_inputs()),
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        served="results/bench/served.json",
        serving="results/serve/vllm.json",
    log:
        "logs/bench.log",
    benchmark:
        "benchmarks/bench.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["bench"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        bench=settings("bench"),
        engine=settings("engine"),
        template_kwargs=config["generation"]["template_kwargs"],
        chat_template=config["target"]["chat_template"],
        multi_turn=config["generation"]["multi_turn"],
    script:
        "../scripts/bench.py"
