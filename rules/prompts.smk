rule prompts:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        target=target_dir(),
        sources=config["prompts"]["sources"],
    output:
        train="results/prompts/train.parquet",
        eval="results/prompts/eval.parquet",
    params:
        prompts=config["prompts"],
        template_kwargs=config["generation"]["template_kwargs"],
    log:
        "logs/prompts.log",
    script:
        "../scripts/prompts.py"
