from eaglepipe import logs, prompts

logs.to_file(snakemake.log[0])
p = snakemake.params.prompts
prompts.run(
    list(snakemake.input.sources),
    {"train": snakemake.output.train, "eval": snakemake.output.eval},
    eval_fraction=p["eval_fraction"],
    max_prompts=p["max_prompts"],
    max_prompt_tokens=p["max_prompt_tokens"],
    too_long=p["too_long"],
    target_dir=snakemake.input.target,
    system_prompt=p["system_prompt"],
    system_policy=p["system_policy"],
    chat_template=snakemake.params.chat_template,
    template_kwargs=snakemake.params.template_kwargs,
    synthesized=snakemake.input.synthesized or None,
    share=snakemake.params.share,
)
