import json
from pathlib import Path

from eaglepipe import gpus, logs, train

logs.to_file(snakemake.log[0])
gpus.claim(snakemake.resources.gpu)
manifest = json.loads(Path(snakemake.input.manifest).read_text())
train.run(
    list(snakemake.input.shards),
    snakemake.input.vocab,
    Path(snakemake.output.model).parent,
    target_dir=snakemake.input.target,
    layer_ids=manifest["layer_ids"],
    settings=snakemake.params.train,
    threads=snakemake.threads,
)
