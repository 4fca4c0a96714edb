rule report:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        trace_stats=rules.trace_stats.output[0],
        coverage=rules.vocab.output.coverage,
        manifest=rules.manifest.output[0],
        train_log=rules.train.output.log,
        acceptance=rules.evaluate.output[0],
        served=rules.bench.output[0],
    output:
        summary="results/report/summary.md",
    params:
        target=config["target"]["name"],
    log:
        "logs/report.log",
    script:
        "../scripts/report.py"
