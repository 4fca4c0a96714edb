"""Draft provenance: what a draft was trained from, recorded in its config.json and compared before any use.

The draft's config.json (results/draft/, a bundle's, the exports') holds under "eaglepipe" a key "provenance":
    {"layer_ids" (the manifest's aux layer ids, "input of layer k"), "layer_convention" (the manifest's),
     "vocab_map_sha256" (vocab_digest of the d2t and t2d it was trained with), "target_fingerprint"
     (eaglepipe.target.fingerprint of the target whose hidden states it learnt), "target_parts" (that target's
     eaglepipe.target.fingerprint_parts: which of its config, tokenizer and weights differ when the fingerprints do;
     drafts trained before it was recorded lack it), "train" (the train.* settings that shape the weights)}
check() compares it, before any work, with the draft's own config and weights, the configured target and, in the
workflow, the manifest and the vocab map; evaluate, rescore, bench and export call it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

# train.* keys that only schedule the work (how many threads, GPUs, processes; how often to checkpoint)
SCHEDULING = ("threads", "gpus", "processes", "checkpoint_every")
RETRAIN = "retrain the draft, or copy config.json and model.safetensors together from the run that trained it"


class ProvenanceError(ValueError):
    pass


def vocab_digest(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    """sha256 of a vocab map's d2t (int64) and t2d (bool) bytes."""
    digest = hashlib.sha256()
    for tensor, dtype in ((d2t, torch.int64), (t2d, torch.bool)):
        digest.update(tensor.to(dtype).contiguous().numpy().tobytes())
        digest.update(b"\0")
    return digest.hexdigest()


def record(*, layer_ids: list[int], layer_convention: str, vocab: dict, target_fingerprint: str,
           settings: dict, target_parts: dict | None = None) -> dict:
    return {"layer_ids": list(layer_ids), "layer_convention": layer_convention,
            "vocab_map_sha256": vocab_digest(vocab["d2t"], vocab["t2d"]), "target_fingerprint": target_fingerprint,
            **({"target_parts": target_parts} if target_parts else {}),
            "train": {k: v for k, v in sorted(settings.items()) if k not in SCHEDULING}}


def target_difference(recorded: dict | None, current: dict) -> tuple[str, str]:
    """In what a target differs from the one a draft was trained for (fingerprint_parts of both), as a parenthesis
    for the mismatch message, and a remedy to put first when the weights are the same and another transformers
    version wrote the files; both empty when the draft recorded no parts."""
    if not recorded:
        return "", ""
    parts = ("config", "tokenizer", "weights")
    differ = [p for p in parts if recorded.get(p) != current.get(p)]
    same = [p for p in parts if p not in differ]
    text = f" (they differ in: {', '.join(differ)}" + (f"; the same: {', '.join(same)}" if same else "") + ")"
    was, now = recorded.get("transformers_version"), current.get("transformers_version")
    if "weights" in differ or was == now:
        return text, ""
    return text, (f"the draft's target was written by transformers {was} and this one by {now}: the same weights, "
                  f"converted by another version; convert the target with transformers {was}, or ")


def _mismatch(path, key: str, value, other_where: str, other, todo: str) -> ProvenanceError:
    return ProvenanceError(f"{path}: {key} is {value!r}, but {other_where} is {other!r}; {todo}")


def check(draft_dir, *, target_dir=None, manifest_path=None, vocab_path=None, remedy: str = RETRAIN) -> dict:
    """Raise ProvenanceError naming the file, the key, both values and what to do when the draft's config, weights,
    recorded provenance, the target (target_dir), the manifest or the vocab map disagree; returns the provenance.
    remedy: what to do about a draft whose own files disagree."""
    from .target import fingerprint, fingerprint_parts

    draft_dir = Path(draft_dir)
    path, weights = draft_dir / "config.json", draft_dir / "model.safetensors"
    try:
        config = json.loads(path.read_text())
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ProvenanceError(f"{path}: not an EAGLE-3 draft config of this pipeline ({type(err).__name__}: {err}); "
                              f"{remedy}") from None
    own = config.get("eaglepipe") or {}
    prov = own.get("provenance")
    if not isinstance(prov, dict):
        raise ProvenanceError(f"{path}: no key eaglepipe.provenance (the layers, vocab map and target the draft was "
                              f"trained on; drafts trained before it was recorded lack it); {remedy}")
    if ids != prov["layer_ids"]:
        raise _mismatch(path, "eagle_config.eagle_aux_hidden_state_layer_ids", ids,
                        "eaglepipe.provenance.layer_ids (the layers it was trained on)", prov["layer_ids"],
                        f"the config was edited after training: set the ids back to {prov['layer_ids']}, or {remedy}")
    if own.get("layer_convention") != prov["layer_convention"]:
        raise _mismatch(path, "eaglepipe.layer_convention", own.get("layer_convention"),
                        "eaglepipe.provenance.layer_convention", prov["layer_convention"],
                        "this folder holds another engine's export, not the draft as trained: point at results/draft/")
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        if not {"d2t", "t2d"} <= names:
            raise ProvenanceError(f"{weights}: no d2t/t2d vocab map in the draft's weights; {remedy}")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if d2t.numel() != config.get("draft_vocab_size"):
        raise _mismatch(path, "draft_vocab_size", config.get("draft_vocab_size"), f"the length of d2t in {weights}",
                        d2t.numel(), f"the config and the weights come from different runs: {remedy}")
    digest = vocab_digest(d2t, t2d)
    if digest != prov["vocab_map_sha256"]:
        raise _mismatch(path, "eaglepipe.provenance.vocab_map_sha256", prov["vocab_map_sha256"],
                        f"the sha256 of the vocab map (d2t, t2d) in {weights}", digest,
                        f"the weights' vocab map is not the one the draft was trained with: {remedy}")
    if target_dir is not None:
        target = fingerprint(target_dir)
        if target != prov["target_fingerprint"]:
            differ, first = target_difference(prov.get("target_parts"), fingerprint_parts(target_dir))
            raise ProvenanceError(f"{path}: eaglepipe.provenance.target_fingerprint is {prov['target_fingerprint']!r}, "
                                  f"but the fingerprint of the configured target {target_dir} (its config, tokenizer "
                                  f"and weights) is {target!r}{differ}; {first}set target.path to the checkpoint "
                                  "the draft was trained for, or train a draft for this one")
    if manifest_path is not None:
        manifest = json.loads(Path(manifest_path).read_text())
        for key in ("layer_ids", "layer_convention", "target_fingerprint"):
            if manifest.get(key) != prov[key]:
                raise _mismatch(path, f"eaglepipe.provenance.{key}", prov[key], f"{key} in {manifest_path}",
                                manifest.get(key), f"the draft was not trained on these hidden states: {remedy}")
    if vocab_path is not None:
        from . import vocab

        mapped = vocab.load(vocab_path)
        if vocab_digest(mapped["d2t"], mapped["t2d"]) != prov["vocab_map_sha256"]:
            raise _mismatch(path, "eaglepipe.provenance.vocab_map_sha256", prov["vocab_map_sha256"],
                            f"the sha256 of {vocab_path}", vocab_digest(mapped["d2t"], mapped["t2d"]),
                            f"the draft was not trained with this vocab map: {remedy}")
    return prov
