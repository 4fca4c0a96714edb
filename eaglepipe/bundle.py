"""A draft bundle: a draft trained elsewhere (e.g. on a GPU machine) with what the bench compares it with, in one
folder. With `bench.draft` set to it, the bench rule serves that draft and nothing upstream of the bench runs.

    config.json, model.safetensors   the draft as results/draft/ holds them (the folder vLLM loads)
    acceptance.json                  its offline acceptance, as results/eval/acceptance.json (served tau is compared
                                     with its `tau`)
    eval.parquet                     the eval prompts that acceptance was measured on, as results/prompts/eval.parquet
    traces/shard-<i>.parquet         optional: the eval trace shards of results/traces/eval/, for the diagnosis's
                                     "prompt ids the traces used" variant; without them that variant is not tried

`python -m eaglepipe.bundle --directory W --out DIR` makes one from a finished workflow directory W (`--variant NAME`:
of the train.variants draft results/drafts/NAME/, its config, weights and acceptance). The bench
checks the draft's config.json against the configured target (hidden size, vocabulary, depth, positions, rope)
before serving it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Bundle file -> (the rule input it stands for, where a workflow directory has it, what it is).
FILES = {
    "config.json": ("config", "results/draft/config.json", "the draft's config"),
    "model.safetensors": ("model", "results/draft/model.safetensors", "the draft's weights"),
    "acceptance.json": ("acceptance", "results/eval/acceptance.json", "the draft's offline acceptance"),
    "eval.parquet": ("prompts", "results/prompts/eval.parquet", "the eval prompts"),
}
TRACES = "results/traces/eval"
MAKE = "python -m eaglepipe.bundle --directory W --out DIR"


def inputs(folder) -> dict:
    """The bench rule's inputs from a bundle (config, model, acceptance, prompts; traces, maybe empty); a missing
    file raises ValueError naming it."""
    folder = Path(folder)
    if not folder.is_dir():
        where = "" if folder.is_absolute() else f" ({folder.absolute()}: relative to the working directory)"
        raise ValueError(f"config key bench.draft: {str(folder)!r}{where} is not a folder; make a draft bundle on "
                         f"the machine that trained the draft ({MAKE}), copy it here and point bench.draft at it, or "
                         "set bench.draft to null to bench this workflow's own draft")
    paths = {}
    for name, (key, source, what) in FILES.items():
        if not (folder / name).is_file():
            raise ValueError(f"draft bundle {folder} (config key bench.draft): {name} is missing ({what}, {source} "
                             f"of the run that trained it); remake the bundle with {MAKE}")
        paths[key] = str(folder / name)
    paths["traces"] = sorted(str(p) for p in (folder / "traces").glob("*.parquet"))
    return paths


def sources(variant: str | None = None) -> dict[str, str]:
    """Bundle file -> where a workflow directory has it: results/draft/ and results/eval/, or with a variant of
    train.variants its results/drafts/<variant>/."""
    paths = {name: source for name, (_, source, _) in FILES.items()}
    if variant:
        paths.update({name: f"results/drafts/{variant}/{name}"
                      for name in ("config.json", "model.safetensors", "acceptance.json")})
    return paths


def make(directory, out, variant: str | None = None) -> Path:
    """Copy a finished workflow directory's draft (or variant's), acceptance, eval prompts and eval traces into a new
    bundle `out`."""
    directory, out = Path(directory), Path(out)
    paths = sources(variant)
    target = paths["acceptance.json"]
    for name, (_, _, what) in FILES.items():
        if not (directory / paths[name]).is_file():
            raise FileNotFoundError(f"{directory / paths[name]}: missing ({what}); a draft bundle needs it: run the "
                                    f"workflow there to {target} first (snakemake --directory {directory} "
                                    f"--configfile <its config> {target})")
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or give another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed, so an interrupted copy leaves no bundle that looks whole.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for name, source in paths.items():
            shutil.copy2(directory / source, tmp / name)
        traces = sorted((directory / TRACES).glob("shard-*.parquet"))
        if traces:
            (tmp / "traces").mkdir()
            for path in traces:
                shutil.copy2(path, tmp / "traces" / path.name)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_fits(draft_dir, target_dir) -> None:
    """Raise ValueError, naming the draft's config.json, when the draft was not trained for this target."""
    from .rope import parameters as rope_parameters
    from .target import read_info

    path = Path(draft_dir) / "config.json"
    try:
        draft = json.loads(path.read_text())
        ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        drafted = {"hidden size": draft["target_hidden_size"], "vocabulary": draft["vocab_size"],
                   "max_position_embeddings": draft["max_position_embeddings"]}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not an EAGLE-3 draft config of this pipeline ({type(err).__name__}: {err}); "
                         f"copy results/draft/config.json of the run that trained it") from None
    info = read_info(target_dir)
    target = {"hidden size": info.hidden_size, "vocabulary": info.vocab_size,
              "max_position_embeddings": info.max_position_embeddings}
    wrong = [f"{key} {drafted[key]} (target {target[key]})" for key in target if drafted[key] != target[key]]
    if max(ids) >= info.num_layers:
        wrong.append(f"aux layer ids {ids} (target has {info.num_layers} layers)")
    positions = {"max_position_embeddings": info.max_position_embeddings}
    if rope_parameters({**draft, **positions}) != rope_parameters({**info.config, **positions}):
        wrong.append(f"rope {rope_parameters(draft)} (target {rope_parameters(info.config)})")
    if wrong:
        raise ValueError(f"{path}: this draft was trained for another target than {target_dir}: " + "; ".join(wrong)
                         + ". Set target.path to the target it was trained for, or bench a draft trained for this one")


def main(argv=None) -> None:
    """python -m eaglepipe.bundle --directory W --out DIR: a bundle of the finished workflow directory W, to bench its
    draft on another machine with `bench.draft` (config/examples/serve-draft.yaml)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--directory", default=".", help="the workflow directory (snakemake --directory); default .")
    parser.add_argument("--out", required=True, help="the bundle folder to create (must not exist)")
    parser.add_argument("--variant", help="a variant of train.variants (results/drafts/NAME/) instead of the draft")
    args = parser.parse_args(argv)
    try:
        out = make(args.directory, args.out, args.variant)
    except (FileNotFoundError, FileExistsError) as err:
        sys.exit(f"error: {err}")
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print(f"draft bundle {out}: {', '.join(names)}")


if __name__ == "__main__":
    main()
