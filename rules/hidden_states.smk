# Each split's hidden-state shards and the records their jobs write beside them.
HIDDEN_SHARDS = {s: shards("results/hidden_states/{split}/shard-{i}.safetensors", [s]) for s in SPLITS}
SHARD_RECORDS = {s: shards("results/hidden_states/{split}/shard-{i}.json", [s]) for s in SPLITS}


rule hidden_states:
    input:
        traces="results/traces/{split}/shard-{i}.parquet",
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        shard="results/hidden_states/{split}/shard-{i}.safetensors",
        # The shard's sha256_tree and counts, written by the same job from the bytes it wrote (the manifest gathers these).
        record="results/hidden_states/{split}/shard-{i}.json",
    log:
        "logs/hidden_states/{split}/shard-{i}.log",
    benchmark:
        "benchmarks/hidden_states/{split}/shard-{i}.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        engine=settings("engine"),
        hidden_states=settings("hidden_states"),
        # Completed chunks for resume after a crash: not an output, so Snakemake keeps it when the job fails.
        progress="results/.progress/hidden_states/{split}/shard-{i}",
        stage=split_shards("results/hidden_states/{split}/shard-{i}.safetensors"),
    script:
        "../scripts/hidden_states.py"


rule manifest:
    input:
        # Only the records: the manifest gathers what extraction wrote and never reads (or re-hashes) a shard.
        train=SHARD_RECORDS["train"],
        eval=SHARD_RECORDS["eval"],
        target=target_dir(),
    output:
        manifest="results/hidden_states/manifest.json",
    log:
        "logs/manifest.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        shards=HIDDEN_SHARDS,
        engine=settings("engine")["name"],
    script:
        "../scripts/manifest.py"


rule validate_shards:
    input:
        manifest=rules.manifest.output.manifest,
        shards=HIDDEN_SHARDS["train"] + HIDDEN_SHARDS["eval"],
        traces=shards("results/traces/{split}/shard-{i}.parquet"),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        validation="results/hidden_states/validation.json",
    log:
        "logs/validate_shards.log",
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["hidden_states"]["validate_threads"]
    params:
        max_length=config["hidden_states"]["max_length"],
    script:
        "../scripts/validate_shards.py"
