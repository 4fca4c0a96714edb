SYNTHESIZE = config["prompts"]["synthesize"]


rule synthesize_prompts:
    input:
        target=target_dir(),
        chat_template=chat_template_file(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        prompts="results/prompts/synthesized.parquet",
        counts="results/prompts/synthesized.json",
    log:
        "logs/synthesize_prompts.log",
    benchmark:
        "benchmarks/synthesize_prompts.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        synthesize=SYNTHESIZE,
        engine=settings("engine"),
        template_kwargs=config["generation"]["template_kwargs"],
        chat_template=config["target"]["chat_template"],
        # Completed chunks for resume after a crash: not an output, so Snakemake keeps it when the job fails.
        progress="results/.progress/synthesize",
    script:
        "../scripts/synthesize_prompts.py"


rule prompts:
    input:
        target=target_dir(),
        sources=prompt_sources(),
        chat_template=chat_template_file(),
        synthesized=rules.synthesize_prompts.output.prompts if SYNTHESIZE["enabled"] else [],
    output:
        train="results/prompts/train.parquet",
        eval="results/prompts/eval.parquet",
    log:
        "logs/prompts.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        # Without synthesis the params are what they were before it existed: no rerun of finished work.
        prompts={k: v for k, v in config["prompts"].items() if k != "synthesize"},
        share=SYNTHESIZE["share"] if SYNTHESIZE["enabled"] else None,
        template_kwargs=config["generation"]["template_kwargs"],
        chat_template=config["target"]["chat_template"],
    script:
        "../scripts/prompts.py"
