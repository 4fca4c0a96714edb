rule report:
    input:
        trace_stats=rules.trace_stats.output.stats,
        coverage=rules.vocab.output.coverage,
        manifest=rules.manifest.output.manifest,
        train_log=rules.train.output.log,
        acceptance=rules.evaluate.output.acceptance,
        served=rules.bench.output.served,
        benchmarks=BENCHMARK_ACCEPTANCE,
        variants=VARIANTS_TABLE,
    output:
        summary="results/report/summary.md",
    log:
        "logs/report.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        target=config["target"]["name"],
    script:
        "../scripts/report.py"


rule plots:
    input:
        coverage=rules.vocab.output.coverage,
        train_log=rules.train.output.log,
        acceptance=rules.evaluate.output.acceptance,
        served=rules.bench.output.served,
    output:
        coverage=report(
            "results/report/coverage.png",
            caption="../report/coverage.rst",
            category="1. Vocabulary",
        ),
        training=report(
            "results/report/training.png",
            caption="../report/training.rst",
            category="2. Training",
        ),
        acceptance=report(
            "results/report/acceptance.png",
            caption="../report/acceptance.rst",
            category="3. Acceptance",
        ),
        positions=report(
            "results/report/positions.png",
            caption="../report/positions.rst",
            category="3. Acceptance",
        ),
        speedup=report(
            "results/report/speedup.png",
            caption="../report/speedup.rst",
            category="4. Served speed",
        ),
        speedup_table=report(
            "results/report/speedup.tsv",
            caption="../report/speedup_table.rst",
            category="4. Served speed",
        ),
    log:
        "logs/plots.log",
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/plots.py"
