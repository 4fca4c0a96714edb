import json
from pathlib import Path

from eaglepipe import gpus, logs, train, validate

logs.to_file(snakemake.log[0])
gpus.claim(snakemake.resources.gpu)
validate.verify_shards(snakemake.input.manifest, snakemake.input.shards)
manifest = json.loads(Path(snakemake.input.manifest).read_text())
settings = snakemake.params.train
train.launch(
    dict(
        shard_paths=list(snakemake.input.shards),
        vocab_path=snakemake.input.vocab,
        out_dir=str(Path(snakemake.output.model).parent),
        target_dir=snakemake.input.target,
        layer_ids=manifest["layer_ids"],
        settings=settings,
        threads=snakemake.threads,
        fingerprint_files=[snakemake.input.manifest, snakemake.input.vocab],
    ),
    train.processes(settings),
)
