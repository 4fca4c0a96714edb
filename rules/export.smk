rule export:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        config=rules.train.output.config,
        model=rules.train.output.model,
        manifest=rules.manifest.output[0],
        target=target_dir(),
    output:
        sglang_config="results/export/sglang/config.json",
        sglang_model="results/export/sglang/model.safetensors",
        checks="results/export/checks.json",
    params:
        serving_context=config["export"]["serving_context"] or config["engine"]["max_model_len"],
    log:
        "logs/export.log",
    script:
        "../scripts/export.py"
