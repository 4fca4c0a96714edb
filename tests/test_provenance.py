"""Drafts carry their provenance (eaglepipe/provenance.py): a draft or bundle whose config, weights or vocab map were
changed after training, or that was trained for other weights, is refused by rescore, evaluate, bench and export
before any work, naming the file, the key, both values and what to do."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglepipe import bench, evaluate, export, provenance
from eaglepipe.config import defaults
from eaglepipe.draft import DraftConfig, Eagle3Draft, save_checkpoint
from eaglepipe.formats import LAYER_CONVENTION, PROMPT_SCHEMA, write_table
from eaglepipe.target import fingerprint
from eaglepipe.tools import rescore

LAYER_IDS = [2, 4, 5]
DRAFT_VOCAB = 512


@pytest.fixture
def bundle(tmp_path, tiny_target):
    """A draft bundle for the tiny target as training writes it (random weights: the checks read configs and the
    vocab map), with the manifest and vocab map of its run beside it."""
    target = json.loads((tiny_target / "config.json").read_text())
    torch.manual_seed(0)
    model = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=LAYER_IDS))
    ids = torch.arange(DRAFT_VOCAB) * 3  # every third target token in the draft vocabulary
    vocab = {"d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": torch.zeros(target["vocab_size"], dtype=torch.bool)}
    vocab["t2d"][ids] = True
    model.d2t.copy_(vocab["d2t"])
    model.t2d.copy_(vocab["t2d"])
    folder = tmp_path / "bundle"
    save_checkpoint(model, folder, provenance.record(
        layer_ids=LAYER_IDS, layer_convention=LAYER_CONVENTION, vocab=vocab,
        target_fingerprint=fingerprint(tiny_target), settings={"lr": 1e-3, "seed": 0, "threads": 4}))
    (folder / "acceptance.json").write_text(json.dumps({"tau": {"2": 1.5}, "max_k": 2}))
    write_table(folder / "eval.parquet", [{"id": "e0", "source": "t", "messages": json.dumps(
        [{"role": "user", "content": "Hi"}])}], PROMPT_SCHEMA)
    (tmp_path / "manifest.json").write_text(json.dumps({"layer_ids": LAYER_IDS, "layer_convention": LAYER_CONVENTION,
                                                        "target_fingerprint": fingerprint(tiny_target)}))
    save_file(vocab, str(tmp_path / "vocab_map.safetensors"))
    return folder


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, change):
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def other_vocab_map(tensors):
    """Target token 1 in the draft vocabulary instead of token 0: a consistent vocab map of another run, same size."""
    ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert ids[0] == 0 and ids[1] > 1
    ids[0] = 1
    tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    tensors["t2d"][[0, 1]] = torch.tensor([False, True])


def shift_ids(config):
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]


# tamper -> (what is done to the bundle, the start of the message after "<bundle>/")
TAMPERS = {
    "aux-ids": (lambda f: edit_config(f, shift_ids),
                ("config.json: eagle_config.eagle_aux_hidden_state_layer_ids is [3, 5, 6], but "
                 "eaglepipe.provenance.layer_ids (the layers it was trained on) is [2, 4, 5]; the config was edited "
                 "after training: set the ids back to [2, 4, 5]")),
    "vocab-size": (lambda f: edit_config(f, lambda c: c.update(draft_vocab_size=256)),
                   ("config.json: draft_vocab_size is 256, but the length of d2t in {folder}/model.safetensors is "
                    "512; the config and the weights come from different runs")),
    "vocab-map": (lambda f: edit_weights(f, other_vocab_map),
                  "config.json: eaglepipe.provenance.vocab_map_sha256 is '"),
}


def refused_by(entry, folder, tmp_path, tiny_target) -> str:
    """The message with which `entry` refuses the draft in `folder`; asserts it wrote nothing."""
    out = tmp_path / "out"
    with pytest.raises((provenance.ProvenanceError, SystemExit)) as err:
        if entry == "rescore":
            rescore.main(["--bundle", str(folder), "--target", str(tiny_target), "--engine", "transformers",
                          "--max-prompts", "1", "--out", str(out / "rescored.json")])
        elif entry == "evaluate":
            evaluate.run([], folder, out / "acceptance.json", target_dir=tiny_target, max_k=2, max_tokens=256,
                         threads=1, manifest_path=tmp_path / "manifest.json")
        elif entry == "bench":
            bench.run(folder / "eval.parquet", folder, folder / "acceptance.json", out / "served.json",
                      out / "vllm.json", target_dir=tiny_target, engine={"max_model_len": 2048},
                      bench={**defaults("bench"), "max_prompts": 1, "max_new_tokens": 2})
        else:
            export.run(folder, tmp_path / "manifest.json", tiny_target, out / "sglang", out / "checks.json",
                       serving_context=2048)
    assert not out.exists()
    return str(err.value)


ENTRIES = ["rescore", "evaluate", "bench", "export"]


def test_an_untouched_draft_passes_the_checks(bundle, tmp_path, tiny_target):
    recorded = provenance.check(bundle, target_dir=tiny_target, manifest_path=tmp_path / "manifest.json",
                                vocab_path=tmp_path / "vocab_map.safetensors")
    assert recorded["layer_ids"] == LAYER_IDS and recorded["train"] == {"lr": 1e-3, "seed": 0}  # no scheduling keys


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("tamper", TAMPERS, ids=list(TAMPERS))
def test_a_tampered_draft_is_refused_before_any_work(bundle, tmp_path, tiny_target, tamper, entry):
    change, message = TAMPERS[tamper]
    change(bundle)
    text = refused_by(entry, bundle, tmp_path, tiny_target)
    assert f"{bundle}/{message.format(folder=bundle)}" in text, text
    assert "retrain the draft" in text or "remake the bundle" in text


@pytest.mark.parametrize("entry", ["rescore", "evaluate", "export"])
def test_a_draft_of_other_weights_is_refused(bundle, tmp_path, tiny_target, entry):
    """The same architecture and tokenizer, one weight changed: only the fingerprint tells the targets apart."""
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    weights = other / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in sorted(tensors) if k.endswith("layers.0.mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights), metadata={"format": "pt"})
    if entry != "rescore":  # the manifest of hidden states from the other target
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "target_fingerprint": fingerprint(other)}))
    text = refused_by(entry, bundle, tmp_path, other)
    assert (f"{bundle}/config.json: eaglepipe.provenance.target_fingerprint is '{fingerprint(tiny_target)}', but the "
            f"fingerprint of the configured target {other}") in text and f"is '{fingerprint(other)}'" in text
    assert "set target.path to the checkpoint the draft was trained for" in text


def test_the_refusal_names_what_differs_in_the_target(bundle, tmp_path, tiny_target):
    """A draft records its target's parts (fingerprint_parts): the refusal says which of config, tokenizer and weights
    differ, and for the same weights written by another transformers version, to convert with the draft's."""
    from eaglepipe.target import fingerprint_parts

    edit_config(bundle, lambda c: c["eaglepipe"]["provenance"].update(target_parts=fingerprint_parts(tiny_target)))
    converted = tmp_path / "converted"
    shutil.copytree(tiny_target, converted)
    config = json.loads((converted / "config.json").read_text())
    was = config.get("transformers_version")
    (converted / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}))
    tokenizer = json.loads((converted / "tokenizer_config.json").read_text())
    (converted / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "legacy": False}))
    with pytest.raises(provenance.ProvenanceError) as err:
        provenance.check(bundle, target_dir=converted)
    assert (f"is '{fingerprint(converted)}' (they differ in: config, tokenizer; the same: weights); the draft's target "
            f"was written by transformers {was} and this one by 0.0.1: the same weights, converted by another "
            f"version; convert the target with transformers {was}, or set target.path") in str(err.value)
    reweighted = tmp_path / "reweighted"
    shutil.copytree(tiny_target, reweighted)
    tensors = load_file(str(reweighted / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(reweighted / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(provenance.ProvenanceError) as err:
        provenance.check(bundle, target_dir=reweighted)
    assert f"is '{fingerprint(reweighted)}' (they differ in: weights; the same: config, tokenizer); set target.path" \
        in str(err.value)
    assert provenance.check(bundle, target_dir=tiny_target)["target_parts"] == fingerprint_parts(tiny_target)


def test_the_vocab_map_of_another_run_is_named(bundle, tmp_path):
    vocab = load_file(str(tmp_path / "vocab_map.safetensors"))
    other_vocab_map(vocab)
    save_file(vocab, str(tmp_path / "other_map.safetensors"))
    with pytest.raises(provenance.ProvenanceError, match=r"config.json: eaglepipe.provenance.vocab_map_sha256 is "
                                                         r"'[0-9a-f]{64}', but the sha256 of .*other_map.safetensors"):
        provenance.check(bundle, vocab_path=tmp_path / "other_map.safetensors")
