from eaglepipe import logs, vocab
from eaglepipe.target import read_info

logs.to_file(snakemake.log[0])
v = snakemake.params.vocab
vocab.run(
    list(snakemake.input.traces),
    snakemake.output.map,
    snakemake.output.coverage,
    target_vocab=read_info(snakemake.input.target).vocab_size,
    draft_vocab_size=v["draft_vocab_size"],
    curve_sizes=v["curve_sizes"],
)
