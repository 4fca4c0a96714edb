rule prompts:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        target=target_dir(),
        sources=prompt_sources(),
        chat_template=chat_template_file(),
    output:
        train="results/prompts/train.parquet",
        eval="results/prompts/eval.parquet",
    params:
        prompts=config["prompts"],
        template_kwargs=config["generation"]["template_kwargs"],
        chat_template=config["target"]["chat_template"],
    log:
        "logs/prompts.log",
    script:
        "../scripts/prompts.py"
