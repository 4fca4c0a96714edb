"""Draft exports for vLLM and SGLang: each engine's layer-id convention, and the config check catching planted
faults."""

import importlib.util
import json
import shutil

import pytest
import torch

from eaglepipe import export, provenance
from eaglepipe.draft import DraftConfig, Eagle3Draft, save_checkpoint
from eaglepipe.formats import LAYER_CONVENTION, sha256_file
from eaglepipe.target import fingerprint

LAYER_IDS = [2, 4, 5]


@pytest.fixture
def draft(tmp_path, tiny_target):
    """A draft in the serving format for the tiny target (random weights: the checks read configs and shapes)."""
    target = json.loads((tiny_target / "config.json").read_text())
    torch.manual_seed(0)
    model = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=512, aux_layer_ids=LAYER_IDS))
    save_checkpoint(model, tmp_path / "draft", provenance.record(
        layer_ids=LAYER_IDS, layer_convention=LAYER_CONVENTION, vocab={"d2t": model.d2t, "t2d": model.t2d},
        target_fingerprint=fingerprint(tiny_target), settings={}))
    (tmp_path / "manifest.json").write_text(json.dumps({"layer_ids": LAYER_IDS, "layer_convention": LAYER_CONVENTION,
                                                        "target_fingerprint": fingerprint(tiny_target)}))
    return tmp_path


def run_export(root, tiny_target, serving_context=2048):
    export.run(root / "draft", root / "manifest.json", tiny_target, root / "export/sglang", root / "export/checks.json",
               serving_context=serving_context)


def edit_config(path, change):
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def test_sglang_export_numbers_layers_as_outputs_and_keeps_the_weights(draft, tiny_target):
    run_export(draft, tiny_target)
    sglang = json.loads((draft / "export/sglang/config.json").read_text())
    vllm = json.loads((draft / "draft/config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert vllm["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert sha256_file(draft / "export/sglang/model.safetensors") == sha256_file(draft / "draft/model.safetensors")
    checks = json.loads((draft / "export/checks.json").read_text())
    assert checks["sglang"]["layer_convention"] == "output_of_layer" and checks["vllm"]["problems"] == []


def shift_ids(c):
    eagle = c["eagle_config"]
    eagle["eagle_aux_hidden_state_layer_ids"] = [k + 1 for k in eagle["eagle_aux_hidden_state_layer_ids"]]


@pytest.mark.parametrize("change, context, message", [
    # The draft's recorded provenance catches these two before the engine checks (eaglepipe/provenance.py).
    (shift_ids, 2048, "eagle_config.eagle_aux_hidden_state_layer_ids is [3, 5, 6], but eaglepipe.provenance.layer_ids"),
    (lambda c: c.update(draft_vocab_size=1024), 2048, "draft_vocab_size is 1024, but the length of d2t in"),
    (lambda c: None, 4096, "max_position_embeddings 2048 is below the serving context 4096"),
    (lambda c: c["rope_parameters"].update(rope_theta=500000.0), 2048, "rope settings"),
], ids=["layer ids off by one", "d2t length", "context", "rope"])
def test_a_planted_fault_fails_the_export_with_its_name(draft, tiny_target, change, context, message):
    edit_config(draft / "draft/config.json", change)
    with pytest.raises(ValueError) as err:
        run_export(draft, tiny_target, serving_context=context)
    assert message in str(err.value)
    assert not (draft / "export/sglang").exists() and not (draft / "export/checks.json").exists()


def test_sglang_check_catches_vllm_numbering(draft, tiny_target):
    """The vLLM config copied unchanged for SGLang is the classic off-by-one: the SGLang check names it."""
    run_export(draft, tiny_target)
    shutil.copyfile(draft / "draft/config.json", draft / "export/sglang/config.json")
    problems = export.check(draft / "export/sglang", "sglang", layer_ids=LAYER_IDS, target_dir=tiny_target,
                            serving_context=2048)
    assert len(problems) == 1 and "sglang numbers as [1, 3, 4] (output_of_layer)" in problems[0]
    assert "differ by +1 each" in problems[0]
    assert export.check(draft / "draft", "vllm", layer_ids=LAYER_IDS, target_dir=tiny_target,
                        serving_context=2048) == []


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="SGLang is not installed: the package index has no CPU build of it (its CPU backend needs "
                           "sgl-kernel built from source), so the SGLang export is checked but not loaded here")
def test_sglang_loads_the_export_and_keeps_greedy_output(draft, tiny_target):
    import sglang

    run_export(draft, tiny_target)
    prompt = {"input_ids": [1, 28, 1456, 314, 260, 3575, 282],
              "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    plain = sglang.Engine(model_path=str(tiny_target), device="cpu", random_seed=0)
    try:
        expected = plain.generate(**prompt)["output_ids"]
    finally:
        plain.shutdown()
    spec = sglang.Engine(model_path=str(tiny_target), device="cpu", random_seed=0, speculative_algorithm="EAGLE3",
                         speculative_draft_model_path=str(draft / "export/sglang"), speculative_num_steps=2,
                         speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    try:
        assert spec.generate(**prompt)["output_ids"] == expected
    finally:
        spec.shutdown()
