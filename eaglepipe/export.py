"""Exports: the draft in the form each serving engine loads, each checked against that engine's conventions.

vLLM loads results/draft/ as trained: aux layer ids as "input of layer k", the pipeline's own numbering. SGLang reads
the ids as "output of layer k" and adds one when capturing (REFERENCE section 4), so its export, results/export/sglang/,
holds the same weights with every id one lower. The check of each export (checks.json) compares its config with the
ids the hidden states were captured at, the vocab map in its weights, the serving context and the target's rope.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from safetensors import safe_open

from . import provenance
from .formats import LAYER_CONVENTION, atomic_path, write_json
from .rope import parameters as rope_parameters
from .target import read_info

log = logging.getLogger(__name__)

# Offset from the pipeline's "input of layer k" ids to each engine's, and the engine's words for its convention.
CONVENTIONS = {"vllm": (0, LAYER_CONVENTION), "sglang": (-1, "output_of_layer")}


def engine_layer_ids(layer_ids: list[int], engine: str) -> list[int]:
    return [k + CONVENTIONS[engine][0] for k in layer_ids]


def sglang_config(config: dict) -> dict:
    """The draft's config.json for SGLang: ids one lower (output of layer k), rope_theta also at the top level."""
    out = json.loads(json.dumps(config))
    out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = engine_layer_ids(
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "sglang")
    out["eaglepipe"] = {**out.get("eaglepipe", {}), "layer_convention": CONVENTIONS["sglang"][1]}
    out.setdefault("rope_theta", rope_parameters(config)["rope_theta"])
    return out


def check(draft_dir, engine: str, *, layer_ids: list[int], target_dir, serving_context: int) -> list[str]:
    """Every way the export at `draft_dir` would serve badly in `engine`; empty when it is fine."""
    draft_dir = Path(draft_dir)
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    target = read_info(target_dir)
    convention = CONVENTIONS[engine][1]
    problems = []
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    expected = engine_layer_ids(layer_ids, engine)
    if ids != expected:
        problems.append(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids is {ids}, but the hidden states were "
                        f"captured at {layer_ids} (input of layer k), which {engine} numbers as {expected} "
                        f"({convention}); re-export the draft (the ids differ by {_offset(ids, expected)})")
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        d2t = f.get_slice("d2t").get_shape()[0] if "d2t" in f.keys() else None
    if d2t != config.get("draft_vocab_size"):
        problems.append(f"{draft_dir / 'model.safetensors'}: d2t has {d2t} entries but config.json says "
                        f"draft_vocab_size {config.get('draft_vocab_size')}; the vocab map and the config come from "
                        "different runs: retrain or re-export")
    if config.get("max_position_embeddings", 0) < serving_context:
        problems.append(f"{path}: max_position_embeddings {config.get('max_position_embeddings')} is below the "
                        f"serving context {serving_context} (export.serving_context); longer prompts would collapse "
                        "acceptance: set it to at least the serving context")
    # Normalised as the trainer ropes (rope.py), so equal here means trained as the engine will serve it.
    if rope_parameters(config) != rope_parameters(target.config):
        problems.append(f"{path}: rope settings {rope_parameters(config)} differ from the target's "
                        f"{rope_parameters(target.config)}; the "
                        "draft must rope positions like the target: copy the target's rope keys into the draft config")
    return problems


def _offset(ids, expected) -> str:
    if ids is not None and len(ids) == len(expected) and len({a - b for a, b in zip(ids, expected)}) == 1:
        return f"{ids[0] - expected[0]:+d} each"
    return "more than a constant"


def run(draft_dir, manifest_path, target_dir, sglang_dir, checks_path, *, serving_context: int | None,
        max_model_len: int = 4096, remedy: str = provenance.RETRAIN) -> None:
    """Write the SGLang export and checks.json; fail, naming every problem, when any export does not pass.
    serving_context None: the context the vLLM engine serves at, max_model_len capped by the target's positions."""
    draft_dir, sglang_dir = Path(draft_dir), Path(sglang_dir)
    provenance.check(draft_dir, target_dir=target_dir, manifest_path=manifest_path, remedy=remedy)
    if serving_context is None:
        serving_context = min(max_model_len, read_info(target_dir).max_position_embeddings)
    layer_ids = json.loads(Path(manifest_path).read_text())["layer_ids"]
    staging = sglang_dir.parent / f".{sglang_dir.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copyfile(draft_dir / "model.safetensors", staging / "model.safetensors")
    config = sglang_config(json.loads((draft_dir / "config.json").read_text()))
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    checks = {engine: check(folder, engine, layer_ids=layer_ids, target_dir=target_dir, serving_context=serving_context)
              for engine, folder in (("vllm", draft_dir), ("sglang", staging))}
    problems = [f"{engine} export: {p.replace(str(staging), str(sglang_dir))}"
                for engine, found in checks.items() for p in found]
    if problems:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError("draft export check failed:\n  " + "\n  ".join(problems))
    for name in ("model.safetensors", "config.json"):
        with atomic_path(sglang_dir / name) as tmp:
            shutil.move(staging / name, tmp)
    shutil.rmtree(staging, ignore_errors=True)
    write_json(checks_path, {engine: {"folder": str(folder), "layer_ids": engine_layer_ids(layer_ids, engine),
                                      "layer_convention": CONVENTIONS[engine][1], "serving_context": serving_context,
                                      "problems": []}
                             for engine, folder in (("vllm", draft_dir), ("sglang", sglang_dir))})
    log.info("exports pass their checks: vLLM %s, SGLang %s (layer ids %s)", draft_dir, sglang_dir,
             engine_layer_ids(layer_ids, "sglang"))
