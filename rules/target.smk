rule target:
    conda:
        "../envs/eaglepipe.yaml"
    output:
        target=directory(EMBEDDED_TARGET),
    log:
        "logs/target.log",
    benchmark:
        "benchmarks/target.tsv"
    script:
        "../scripts/target.py"
