"""Offline acceptance of a bundle's draft on the conversations the bench serves, from hidden states this machine's
target computes: the figure the served tau is compared with, when the bundle's acceptance.json has no per-conversation
counts (bundles made before `by_sequence`) or was measured with another machine's numerics (a GPU's bf16).

Usage (the same --max-prompts and --seed as the bench's, config/examples/serve-draft.yaml):
    python -m eaglepipe.tools.rescore --bundle draft-bundle --target resources/targets/smollm2-135m \
        --max-prompts 32 --seed 0 --out rescored.json [--engine vllm] [--threads 2]

It selects the bench's sample of the bundle's eval prompts (eaglepipe.bench.served_rows), takes their traces from the
bundle (traces/shard-*.parquet), extracts their hidden states with the engine (as the hidden_states stage does, into a
temporary shard) and scores the draft on them (eaglepipe.evaluate.over_texts); --max-new-tokens scores only the part of
each response the bench generates. The output is an acceptance.json with
by_sequence, plus `rescored` (engine, prompts, seed) and `bundle_tau` (the bundle's own figure over its whole eval
split). Put it in a copy of the bundle as acceptance.json and the bench compares served with it, prompt for prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import served_rows
from ..formats import PROMPT_SCHEMA, TRACE_SCHEMA, read_table, write_json


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="the draft bundle folder (eaglepipe/bundle.py)")
    parser.add_argument("--target", required=True, help="the target checkpoint folder the bench serves")
    parser.add_argument("--max-prompts", type=int, default=16, help="bench.max_prompts (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="bench.seed (default 0)")
    parser.add_argument("--first", action="store_true", help="the first --max-prompts by id (bench.seed: null)")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"], help="extraction engine")
    parser.add_argument("--dtype", default="float32", help="engine.dtype (default float32, as config/config.yaml)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--max-length", type=int, default=2048, help="hidden_states.max_length (default 2048)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="score only the first N response tokens of each trace (bench.max_new_tokens: the part "
                             "the bench serves); default: whole responses, as the evaluate stage")
    parser.add_argument("--regenerate", action="store_true",
                        help="score the continuations this machine's target generates (greedy, --max-new-tokens) "
                             "instead of the bundle's traces: the text the bench serves, token for token")
    parser.add_argument("--also", nargs="+", default=[], metavar="DRAFT",
                        help="other draft folders (config.json + model.safetensors, same aux layers) scored on the "
                             "same hidden states: `also` in the output, by folder (e.g. an anchor trainer's draft)")
    parser.add_argument("--out", required=True, help="the acceptance JSON to write")
    args = parser.parse_args(argv)
    if args.regenerate and args.max_new_tokens is None:
        sys.exit("error: --regenerate needs --max-new-tokens (bench.max_new_tokens)")
    seed = None if args.first else args.seed

    from .. import evaluate, provenance
    from ..bundle import MAKE

    bundle = Path(args.bundle)
    try:  # before any work: a draft whose files disagree, or of another target, would be scored at the wrong layers
        provenance.check(bundle, target_dir=args.target, remedy=f"remake the bundle with {MAKE}")
    except provenance.ProvenanceError as err:
        sys.exit(f"error: {err}")
    traces = sorted((bundle / "traces").glob("shard-*.parquet"))
    if not traces:
        sys.exit(f"error: {bundle}/traces has no shard-*.parquet: the bundle carries no eval traces to rescore")
    rows = served_rows(read_table(bundle / "eval.parquet", PROMPT_SCHEMA), args.max_prompts, seed)
    wanted = {r["id"] for r in rows}
    traced = [t for path in traces for t in read_table(path, TRACE_SCHEMA) if t["id"] in wanted]
    missing = wanted - {t["id"] for t in traced}
    if missing:
        sys.exit(f"error: {bundle}/traces lacks the traces of {len(missing)} served prompts, "
                 f"e.g. {sorted(missing)[:3]}")
    if args.max_new_tokens is not None and not args.regenerate:  # the loss mask's spans are clipped to match
        traced = [{**t, "output_ids": list(t["output_ids"])[: args.max_new_tokens],
                   "output_tokens": min(len(t["output_ids"]), args.max_new_tokens)} for t in traced]
    draft = json.loads((bundle / "config.json").read_text())
    layer_ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    for other in args.also:  # before any work: the hidden states extracted here fit only drafts of the same layers
        config = Path(other) / "config.json"
        if not config.is_file():
            sys.exit(f"error: --also {other}: no config.json there (a draft folder: config.json + model.safetensors)")
        other_layers = json.loads(config.read_text()).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        if other_layers != layer_ids:
            sys.exit(f"error: {config} takes aux layers {other_layers}, the bundle's draft {layer_ids}: "
                     "score it with a bundle of its own layers")
    engine = {"name": args.engine, "device": "cpu", "dtype": args.dtype, "threads": args.threads, "gpus": 0}
    if args.regenerate:
        from ..engines import open_engine
        from ..engines.base import EngineSettings, Sampling

        with open_engine(args.target, EngineSettings.from_config(engine)) as eng:
            made = eng.generate([list(t["prompt_ids"]) for t in traced], Sampling(max_new_tokens=args.max_new_tokens))
        traced = evaluate.continuation_rows([t["id"] for t in traced], [t["prompt_ids"] for t in traced], made)
    own = json.loads((bundle / "acceptance.json").read_text())
    settings = dict(target_dir=args.target, layer_ids=layer_ids, engine=engine, max_k=int(own["max_k"]),
                    max_length=args.max_length, threads=args.threads)
    result, *others = evaluate.over_texts(traced, [bundle, *args.also], **settings)
    result["also"] = dict(zip(map(str, args.also), others))  # an acceptance.json of its own for each
    result["rescored"] = {"engine": args.engine, "dtype": args.dtype, "prompts": len(rows), "seed": seed,
                          "max_length": args.max_length, "max_new_tokens": args.max_new_tokens,
                          "regenerated": args.regenerate,
                          "target": str(args.target)}
    result["bundle_tau"] = own["tau"]
    write_json(args.out, result)
    print(json.dumps({"sequences": len(result["by_sequence"]), "positions": result["positions"],
                      "tau": {k: round(v, 3) for k, v in result["tau"].items()},
                      "bundle_tau": {k: round(v, 3) for k, v in own["tau"].items()},
                      "also": {k: {n: round(v, 3) for n, v in r["tau"].items()} for k, r in result["also"].items()}}))
    return result


if __name__ == "__main__":
    main()
