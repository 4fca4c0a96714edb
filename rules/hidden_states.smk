# Each split's hidden-state shards and the records their jobs write beside them.
HIDDEN_SHARDS = {s: shards("results/hidden_states/{split}/shard-{i}.safetensors", [s]) for s in SPLITS}
SHARD_RECORDS = {s: shards("results/hidden_states/{split}/shard-{i}.json", [s]) for s in SPLITS}


rule hidden_states:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        traces="results/traces/{split}/shard-{i}.parquet",
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        shard="results/hidden_states/{split}/shard-{i}.safetensors",
        # The shard's sha256_tree and counts, written by the same job from the bytes it wrote (the manifest gathers these).
        record="results/hidden_states/{split}/shard-{i}.json",
    params:
        engine=settings("engine"),
        hidden_states=settings("hidden_states"),
        # Completed chunks for resume after a crash: not an output, so Snakemake keeps it when the job fails.
        progress="results/.progress/hidden_states/{split}/shard-{i}",
        stage=split_shards("results/hidden_states/{split}/shard-{i}.safetensors"),
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/hidden_states/{split}/shard-{i}.log",
    benchmark:
        "benchmarks/hidden_states/{split}/shard-{i}.tsv"
    script:
        "../scripts/hidden_states.py"


rule manifest:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        # Only the records: the manifest gathers what extraction wrote and never reads (or re-hashes) a shard.
        train=SHARD_RECORDS["train"],
        eval=SHARD_RECORDS["eval"],
        target=target_dir(),
    output:
        manifest="results/hidden_states/manifest.json",
    params:
        shards=HIDDEN_SHARDS,
        engine=settings("engine")["name"],
    log:
        "logs/manifest.log",
    script:
        "../scripts/manifest.py"


rule validate_shards:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        manifest=rules.manifest.output.manifest,
        shards=HIDDEN_SHARDS["train"] + HIDDEN_SHARDS["eval"],
        traces=shards("results/traces/{split}/shard-{i}.parquet"),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        validation="results/hidden_states/validation.json",
    params:
        max_length=config["hidden_states"]["max_length"],
    threads: config["hidden_states"]["validate_threads"]
    log:
        "logs/validate_shards.log",
    script:
        "../scripts/validate_shards.py"
