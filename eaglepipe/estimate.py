"""What a configuration will cost before it runs: prompts, tokens, hidden-state bytes, GPU jobs.

`plan(config)` takes a validated config (defaults filled); the workflow prints it on dry runs, and schedulers can
call it. Tokens come from results/traces/stats.json when generation has run, otherwise they are an upper bound:
prompts x min(max_prompt_tokens + max_new_tokens, hidden_states.max_length).
"""

from __future__ import annotations

import json
from pathlib import Path

from .formats import bytes_per_token
from .target import EMBEDDED_DIR, EMBEDDED_INFO, TargetInfo, read_info


def target_facts(config: dict, embedded_dir=EMBEDDED_DIR) -> dict:
    """Depth, hidden size and vocab of the target: from its config.json when present, else from target.info (or
    the embedded default's known figures). A checkpoint that disagrees with target.info is an error."""
    path = config["target"]["path"] or embedded_dir
    given = config["target"].get("info") or (EMBEDDED_INFO if config["target"]["path"] is None else None)
    if Path(path, "config.json").is_file():
        info = read_info(path)
        real = {"num_layers": info.num_layers, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size}
        wrong = {k: (v, real[k]) for k, v in (config["target"].get("info") or {}).items() if real[k] != v}
        if wrong:
            raise ValueError(f"config key target.info disagrees with {path}/config.json: " + ", ".join(
                f"{k} is {v} in config but {r} in the checkpoint" for k, (v, r) in wrong.items()))
        return real
    if given is None:
        raise ValueError(f"config key target.path: {path!r} is not a checkpoint folder (no config.json there); "
                         "point it at a local Hugging Face checkpoint, set it to null for the embedded default, or "
                         "give target.info (num_layers, hidden_size, vocab_size) to plan without it")
    return dict(given)


def count_prompts(config: dict) -> int | None:
    """Prompt records in the sources (capped by prompts.max_prompts); None when a source is absent and no cap."""
    from .prompts import count_records, default_source

    p = config["prompts"]
    synth = p.get("synthesize", {})
    enabled, share = synth.get("enabled", False), synth.get("share")
    total = 0
    for source in [] if enabled and share == 1 else (p["sources"] or [default_source()]):
        path = Path(source)
        if not path.is_file():
            return p["max_prompts"]
        total += count_records(path)
    if enabled:  # an upper bound: every sample drawn kept, then mixed at prompts.synthesize.share
        count = synth["count"]
        total = total + count if share is None else min(total / (1 - share) if share < 1 else count, count / share)
        total = int(total)
    return min(total, p["max_prompts"]) if p["max_prompts"] else total


def gpu_rules(config: dict) -> list[dict]:
    """Rules that claim GPUs: jobs per run and GPUs per job (resources gpu=N), in the order they run."""
    shards = 2 * config["generation"]["num_shards"]  # train and eval splits
    engine, train = config["engine"]["gpus"], config["train"]["gpus"]
    scoring = 1 if config["evaluate"].get("device", "cpu").startswith("cuda") else 0
    sets = len(config["evaluate"].get("benchmarks") or [])
    variants = len(config["train"].get("variants") or {})
    rows = [("synthesize_prompts", 1 if config["prompts"].get("synthesize", {}).get("enabled") else 0, engine),
            ("traces", shards, engine), ("hidden_states", shards, engine),
            ("benchmark_traces", sets, engine), ("benchmark_hidden_states", sets, engine)]
    if variants:  # each variant trained and scored; the best is copied to results/draft/
        rows += [("train_variant", variants, train), ("evaluate_variant", variants, scoring),
                 ("benchmark_evaluate_variant", variants * sets, scoring)]
    else:
        rows.append(("train", 1, train))
    rows += [("evaluate", 1, scoring), ("benchmark_evaluate", sets, scoring), ("bench", 1, engine)]
    return [{"rule": r, "jobs": n, "gpus_per_job": g} for r, n, g in rows if n > 0 and g > 0]


def plan(config: dict, stats_path="results/traces/stats.json") -> dict:
    facts = target_facts(config)
    layers = config["hidden_states"]["aux_layer_ids"] or TargetInfo(facts["num_layers"], facts["hidden_size"],
                                                                     facts["vocab_size"], 0, {}).default_layer_ids()
    prompts = count_prompts(config)
    if Path(stats_path).is_file():
        stats = json.loads(Path(stats_path).read_text())
        tokens = sum(s["prompt_tokens"] + s["output_tokens"] for s in stats.values())
        source = str(stats_path)
    else:
        per = min(config["prompts"]["max_prompt_tokens"] + config["generation"]["max_new_tokens"],
                  config["hidden_states"]["max_length"])
        tokens = None if prompts is None else prompts * per
        source = f"upper bound: prompts x {per} tokens"
    dtype = config["hidden_states"]["dtype"]
    per_token = bytes_per_token(dtype, len(layers), facts["hidden_size"])
    return {
        "target": {**facts, "aux_layer_ids": layers}, "prompts": prompts, "tokens": tokens, "tokens_from": source,
        "hidden_state_dtype": dtype, "hidden_state_bytes_per_token": per_token,
        "hidden_state_bytes": None if tokens is None else tokens * per_token, "gpu_rules": gpu_rules(config),
    }


def format_plan(p: dict) -> str:
    def size(n):
        return "unknown" if n is None else f"{n / 1e9:,.1f} GB ({n:,} bytes)"

    t = p["target"]
    lines = [
        f"plan: target {t['num_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']}, "
        f"aux layer ids {t['aux_layer_ids']}",
        f"plan: prompts {p['prompts'] if p['prompts'] is not None else 'unknown'}; tokens "
        f"{'unknown' if p['tokens'] is None else format(p['tokens'], ',')} ({p['tokens_from']})",
        f"plan: hidden states {p['hidden_state_bytes_per_token']:,} bytes per token "
        f"(({len(t['aux_layer_ids'])} aux + final) x {t['hidden_size']} in {p['hidden_state_dtype']}, token id, "
        f"loss mask): {size(p['hidden_state_bytes'])}",
    ]
    gpus = ", ".join(f"{g['rule']} ({g['jobs']} jobs x gpu={g['gpus_per_job']})" for g in p["gpu_rules"])
    lines.append(f"plan: GPU rules: {gpus or 'none (CPU run)'}")
    return "\n".join(lines)


def main(argv=None) -> None:
    """python -m eaglepipe.estimate --configfile A.yaml [B.yaml ...]: the plan over config/config.yaml."""
    import argparse

    from .config import SCHEMA, load, validate

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--configfile", nargs="+", default=[])
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    config: dict = {}
    for path in [SCHEMA.parent / "config.yaml", *args.configfile]:
        for key, value in load(path).items():
            config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    p = plan(validate(config))
    print(json.dumps(p, indent=2) if args.json else format_plan(p))


if __name__ == "__main__":
    main()
