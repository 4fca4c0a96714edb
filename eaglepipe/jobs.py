"""One function per Snakemake rule, named for it: each sends logging to the rule's log, unpacks the rule's
`snakemake` object (input, output, params, resources, wildcards) and runs the job, so every script in scripts/ is a
single call. Stage modules are imported inside each function, after logging goes to the log, so a job loads only
its own stage (no torch or vLLM for the small rules)."""

from __future__ import annotations

from pathlib import Path

from . import logs
from .formats import rebuild


def _start(smk, *, gpus: bool = False) -> None:
    """Logging into the rule's log; for GPU rules, then lock the job's `gpu` slots as its CUDA_VISIBLE_DEVICES."""
    logs.to_file(smk.log[0])
    if gpus:
        from . import gpus as gpu_slots

        gpu_slots.claim(smk.resources.gpu)


def _engine(smk) -> dict:
    return {**smk.params.engine, "threads": smk.threads}


def _settings(smk, section: str) -> dict:
    """A config section as the job uses it: the rule's params (the keys that change outputs) with the scheduling
    keys the rule leaves out of them (rules/common.smk `settings`)."""
    return {**smk.config[section], **getattr(smk.params, section)}


def target(smk) -> None:
    _start(smk)
    from . import target as stage

    stage.fetch_embedded(smk.output.target)


def target_fingerprint(smk) -> None:
    _start(smk)
    from . import target as stage

    stage.write_fingerprint(smk.input.target, smk.output.fingerprint)


def synthesize_prompts(smk) -> None:
    _start(smk, gpus=True)
    from . import preflight, synthesize

    s = smk.params.synthesize
    preflight.run_job(
        smk.config,
        smk.input.target,
        output_path=smk.output.prompts,
        # Resume units hold every sample's token ids; the kept prompts are smaller.
        needed_bytes=preflight.trace_bytes(s["count"], 0, s["max_new_tokens"]),
        stage_outputs=[smk.output.prompts],
        what="synthesized prompts",
        gpus=smk.resources.gpu,
    )
    synthesize.run(
        smk.output.prompts,
        smk.output.counts,
        target_dir=smk.input.target,
        engine=_engine(smk),
        settings=s,
        template_kwargs=smk.params.template_kwargs,
        chat_template=smk.params.chat_template,
        progress_dir=smk.params.progress,
    )


def prompts(smk) -> None:
    _start(smk)
    from . import prompts as stage

    p = smk.params.prompts
    stage.run(
        list(smk.input.sources),
        {"train": smk.output.train, "eval": smk.output.eval},
        eval_fraction=p["eval_fraction"],
        max_prompts=p["max_prompts"],
        max_prompt_tokens=p["max_prompt_tokens"],
        too_long=p["too_long"],
        target_dir=smk.input.target,
        system_prompt=p["system_prompt"],
        system_policy=p["system_policy"],
        chat_template=smk.params.chat_template,
        template_kwargs=smk.params.template_kwargs,
        synthesized=smk.input.synthesized or None,
        share=smk.params.share,
    )


def traces(smk) -> None:
    _start(smk, gpus=True)
    from . import preflight

    g = smk.params.generation
    shard = int(smk.wildcards.i)
    preflight.run_job(
        smk.config,
        smk.input.target,
        output_path=smk.output.shard,
        needed_bytes=preflight.traces_estimate(smk.input.prompts, shard, g["num_shards"], g["max_new_tokens"]),
        stage_outputs=smk.params.stage,
        what="trace shards",
        gpus=smk.resources.gpu,
    )
    _generate(smk, smk.output.shard, split=smk.wildcards.split, shard=shard, num_shards=g["num_shards"],
              multi_turn=g["multi_turn"])


def _generate(smk, output_path, *, split: str, shard: int, num_shards: int, multi_turn: str) -> None:
    """The trace stage of the job's rule (traces, benchmark_traces) on its prompts into output_path."""
    from . import traces as stage

    g = smk.params.generation
    stage.run(
        smk.input.prompts,
        output_path,
        target_dir=smk.input.target,
        split=split,
        shard=shard,
        num_shards=num_shards,
        engine=_engine(smk),
        sampling={k: g[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")},
        template_kwargs=g["template_kwargs"],
        chunk_size=g["chunk_size"],
        max_error_share=g["max_error_share"],
        chat_template=smk.params.chat_template,
        reasoning_markers=smk.params.reasoning,
        multi_turn=multi_turn,
        progress_dir=smk.params.progress,
    )


def trace_stats(smk) -> None:
    _start(smk)
    from . import traces as stage

    stage.stats(list(smk.input.shards), smk.output.stats)


def vocab(smk) -> None:
    _start(smk)
    from . import vocab as stage
    from .target import read_info

    v = smk.params.vocab
    stage.run(
        list(smk.input.traces),
        smk.output.map,
        smk.output.coverage,
        target_vocab=read_info(smk.input.target).vocab_size,
        draft_vocab_size=v["draft_vocab_size"],
        curve_sizes=v["curve_sizes"],
    )


def hidden_states(smk) -> None:
    _start(smk, gpus=True)
    from . import preflight
    from .target import read_info

    h = smk.params.hidden_states
    preflight.run_job(
        smk.config,
        smk.input.target,
        output_path=smk.output.shard,
        needed_bytes=preflight.hidden_states_estimate(smk.input.traces, h["max_length"],
                                                      read_info(smk.input.target).hidden_size, dtype=h["dtype"]),
        stage_outputs=smk.params.stage,
        what="hidden-state shards",
        gpus=smk.resources.gpu,
        resume_copy=False,  # extraction resumes from its partial shard, not from a copy of the rows
    )
    _extract(smk, smk.output.shard, dtype=h["dtype"])


def _extract(smk, output_path, *, dtype: str) -> None:
    """The hidden-state stage of the job's rule (hidden_states, benchmark_hidden_states) on its traces."""
    from . import hidden_states as stage

    h = smk.params.hidden_states
    stage.run(
        smk.input.traces,
        output_path,
        target_dir=smk.input.target,
        layer_ids=h["aux_layer_ids"],
        engine=_engine(smk),
        max_length=h["max_length"],
        chunk_size=h["chunk_size"],
        dtype=dtype,
        progress_dir=smk.params.progress,
        record_path=smk.output.record,
    )


def manifest(smk) -> None:
    _start(smk)
    from . import hidden_states as stage

    stage.manifest(
        smk.params.shards,
        {"train": list(smk.input.train), "eval": list(smk.input.eval)},
        smk.output.manifest,
        target_dir=smk.input.target,
        engine=smk.params.engine,
    )


def validate_shards(smk) -> None:
    _start(smk)
    from . import validate
    from .target import read_fingerprint

    validate.run(
        smk.input.manifest,
        {f"{Path(p).parent.name}/{Path(p).stem}": p for p in smk.input.traces},
        smk.output.validation,
        max_length=smk.params.max_length,
        threads=smk.threads,
        target_fingerprint=read_fingerprint(smk.input.fingerprint),
    )


def train(smk) -> None:
    _start(smk, gpus=True)
    import json

    from . import train as stage
    from . import validate

    validate.verify_shards(smk.input.manifest, smk.input.shards, smk.threads)
    manifest = json.loads(Path(smk.input.manifest).read_text())
    settings = _settings(smk, "train")
    stage.launch(
        dict(
            shard_paths=list(smk.input.shards),
            vocab_path=smk.input.vocab,
            out_dir=str(Path(smk.output.model).parent),
            target_dir=smk.input.target,
            layer_ids=manifest["layer_ids"],
            settings=settings,
            threads=smk.threads,
            key_files=[smk.input.manifest, smk.input.vocab],
        ),
        stage.processes(settings),
    )


def select_variant(smk) -> None:
    _start(smk)
    from . import variants

    variants.select(
        smk.params.variants,
        list(smk.input.acceptance),
        {"config": list(smk.input.config), "model": list(smk.input.model), "log": list(smk.input.train_log)},
        {"config": smk.output.config, "model": smk.output.model, "log": smk.output.log},
    )


def variants(smk) -> None:
    _start(smk)
    from . import plots
    from . import variants as stage

    stage.compare(
        list(smk.params.overrides),
        smk.params.overrides,
        acceptance=list(smk.input.acceptance),
        train_log=list(smk.input.train_log),
        seconds=list(smk.input.seconds),
        benchmarks=list(smk.input.benchmarks),
        output_path=smk.output.table,
    )
    plots.variants(smk.output.table, smk.output.plot)


def evaluate(smk) -> None:
    _start(smk, gpus=True)
    from . import evaluate as stage
    from . import validate

    validate.verify_shards(smk.input.manifest, smk.input.shards, smk.threads)
    stage.run(
        list(smk.input.shards),
        Path(smk.input.model).parent,
        smk.output.acceptance,
        target_dir=smk.input.target,
        max_k=smk.params.max_k,
        max_tokens=smk.params.max_tokens,
        threads=smk.threads,
        device=smk.params.device,
        temperatures=smk.params.temperatures,
        manifest_path=smk.input.manifest,
        remedy=f"retrain it with {rebuild('train')}",
    )


def fetch_mtbench(smk) -> None:
    _start(smk)
    from . import benchmarks

    benchmarks.fetch_mtbench(smk.output.questions)


def benchmark_prompts(smk) -> None:
    _start(smk)
    from . import benchmarks

    benchmarks.prompts(smk.input.questions[0], smk.wildcards.bench, smk.output.prompts)


def benchmark_contamination(smk) -> None:
    _start(smk)
    from . import benchmarks

    benchmarks.check_contamination(smk.params.benchmarks, smk.input.train, smk.output.check,
                                   threshold=smk.params.threshold)


def benchmark_traces(smk) -> None:
    _start(smk, gpus=True)
    # every turn answered after the target's own earlier answers
    _generate(smk, smk.output.traces, split=smk.wildcards.bench, shard=0, num_shards=1, multi_turn="all")


def benchmark_hidden_states(smk) -> None:
    _start(smk, gpus=True)
    _extract(smk, smk.output.shard, dtype="bfloat16")  # one small shard: kept exact whatever hidden_states.dtype


def benchmark_evaluate(smk) -> None:
    _start(smk, gpus=True)
    from . import benchmarks
    from . import evaluate as stage
    from .formats import write_json

    result = stage.measure(
        [smk.input.shard],
        Path(smk.input.model).parent,
        target_dir=smk.input.target,
        max_k=smk.params.max_k,
        max_tokens=smk.params.max_tokens,
        threads=smk.threads,
        device=smk.params.device,
        temperatures=smk.params.temperatures,
        remedy=f"retrain it with {rebuild('train')}",
    )
    write_json(smk.output.acceptance, benchmarks.score(result, smk.input.questions[0], smk.wildcards.bench))


def bench(smk) -> None:
    _start(smk, gpus=True)
    from . import bench as stage

    stage.run(
        smk.input.prompts,
        Path(smk.input.model).parent,
        smk.input.acceptance,
        smk.output.served,
        smk.output.serving,
        target_dir=smk.input.target,
        engine=_engine(smk),
        bench=smk.params.bench,
        template_kwargs=smk.params.template_kwargs,
        traces=list(smk.input.traces),
        chat_template=smk.params.chat_template,
        multi_turn=smk.params.multi_turn,
    )


def export(smk) -> None:
    _start(smk)
    from . import export as stage

    stage.run(
        Path(smk.input.model).parent,
        smk.input.manifest,
        smk.input.target,
        Path(smk.output.sglang_config).parent,
        smk.output.checks,
        serving_context=smk.params.serving_context,
        max_model_len=smk.params.max_model_len,
        remedy=f"retrain it with {rebuild('train')}",
    )


def report(smk) -> None:
    _start(smk)
    from . import report as stage

    stage.summary(target=smk.params.target, output_path=smk.output.summary, **dict(smk.input.items()))


def plots(smk) -> None:
    _start(smk)
    from . import plots as stage

    stage.run(
        coverage_path=smk.input.coverage,
        train_log=smk.input.train_log,
        acceptance_path=smk.input.acceptance,
        served_path=smk.input.served,
        outputs=dict(smk.output.items()),
    )
