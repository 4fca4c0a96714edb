"""benchmarks/anchor_convert.py to-eaglepipe, the half of the anchor comparison that needs no GPU and no speculators:
a checkpoint in speculators' Eagle-3 layout (its parameter names, its verifier tensors, its config flags) becomes our
draft folder, weight for weight; a checkpoint with norms our draft lacks is refused by name. (to-speculators needs
speculators' `datasets` and the trainer an accelerator: benchmarks/anchor.sh runs both on the GPU.)"""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO
from eaglepipe.draft import DraftConfig, Eagle3Draft, save_checkpoint

spec = importlib.util.spec_from_file_location("anchor_convert", REPO / "benchmarks" / "anchor_convert.py")
anchor_convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(anchor_convert)

AUX = [2, 4, 5]


def speculators_checkpoint(tiny_target, tmp_path, **flags):
    """Our draft saved as a speculators checkpoint would hold it; returns (its folder, our original folder)."""
    target = json.loads((tiny_target / "config.json").read_text())
    torch.manual_seed(0)
    model = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=512, aux_layer_ids=AUX))
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[100:612] = True  # draft token i is target token 100 + i
        model.d2t.fill_(100)
    ours = tmp_path / "ours"
    save_checkpoint(model, ours)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(ours / "model.safetensors")).items()}
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    state |= {"embed_tokens.weight": torch.randn(vocab, hidden, dtype=torch.bfloat16),
              "verifier_lm_head.weight": torch.randn(vocab, hidden, dtype=torch.bfloat16),
              "verifier_norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(state, str(ckpt / "model.safetensors"))
    config = {"speculators_model_type": "eagle3", "draft_vocab_size": 512, "eagle_aux_hidden_state_layer_ids": AUX,
              "norm_before_fc": False, "fc_norm": False, "norm_output": False, "norm_before_residual": False,
              "transformer_layer_config": {"num_hidden_layers": 1, "hidden_size": hidden}} | flags
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, ours


def test_a_speculators_checkpoint_becomes_our_draft_weight_for_weight(tiny_target, tmp_path):
    ckpt, ours = speculators_checkpoint(tiny_target, tmp_path)
    out = tmp_path / "converted"
    anchor_convert.main(["to-eaglepipe", "--target", str(tiny_target), "--checkpoint", str(ckpt),
                         "--aux-layer-ids", *map(str, AUX), "--out", str(out)])
    got, want = load_file(str(out / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert json.loads((out / "config.json").read_text()) == json.loads((ours / "config.json").read_text())


@pytest.mark.parametrize("flags, message", [({"norm_before_fc": True}, "norm_before_fc"),
                                            ({"transformer_layer_config": {"num_hidden_layers": 2}}, "2 draft layers")])
def test_a_checkpoint_our_draft_cannot_hold_is_refused(tiny_target, tmp_path, flags, message):
    ckpt, _ = speculators_checkpoint(tiny_target, tmp_path, **flags)
    with pytest.raises(SystemExit, match=message):
        anchor_convert.main(["to-eaglepipe", "--target", str(tiny_target), "--checkpoint", str(ckpt),
                             "--aux-layer-ids", *map(str, AUX), "--out", str(tmp_path / "converted")])
    assert not (tmp_path / "converted").exists()
