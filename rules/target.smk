rule target:
    output:
        target=directory(EMBEDDED_TARGET),
    log:
        "logs/target.log",
    benchmark:
        "benchmarks/target.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/target.py"


# The target's fingerprint, weights included (eaglepipe.target.fingerprint): the input through which a checkpoint
# changed in place re-runs the rules that read the target (the folder itself is ancient: its mtime says nothing).
rule target_fingerprint:
    input:
        target=target_dir(),
    output:
        fingerprint=TARGET_FINGERPRINT,
    log:
        "logs/target_fingerprint.log",
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/target_fingerprint.py"
