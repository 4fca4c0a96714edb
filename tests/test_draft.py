import json

import torch

from eaglepipe.batches import collate, plan, step_inputs
from eaglepipe.draft import DraftConfig, Eagle3Draft, load_checkpoint, save_checkpoint
from eaglepipe.evaluate import summarise

H, V, VD = 32, 100, 20


def tiny_draft(seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    target = {"hidden_size": H, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "vocab_size": V, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0}
    model = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3]))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.d2t.copy_(torch.arange(VD) * 3)  # draft token i is target token 4i
    model.t2d[torch.arange(VD) * 4] = True
    return model


def fake_shard(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return {
        "input_ids": torch.randint(0, V, (t,), generator=g, dtype=torch.int32),
        "loss_mask": torch.ones(t, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0] + lengths).cumsum(0),
        "aux": torch.randn(t, 3, H, generator=g).to(torch.bfloat16),
        "final": torch.randn(t, H, generator=g).to(torch.bfloat16),
    }


def outputs(model, shard, seqs, steps=3):
    batch = collate(shard, seqs, 10_000, torch.float32, "cpu")
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return [o[0] for o in model.unroll(batch.aux, step_inputs(batch, steps, embed), batch.positions, batch.mask)]


def test_packed_sequences_do_not_see_each_other():
    model, shard = tiny_draft(), fake_shard([7, 5])
    packed = outputs(model, shard, [0, 1])
    alone = outputs(model, shard, [1])
    for j in range(3):
        # Positions of sequence 1 (packed at 7..11) match sequence 1 run alone, at every unroll step,
        # except the last positions whose shifted inputs run past the sequence (they are never scored).
        torch.testing.assert_close(packed[j][7:12 - 1 - j], alone[j][: 5 - 1 - j], rtol=1e-4, atol=1e-5)


def test_unroll_is_causal_at_every_step():
    model = tiny_draft()
    a, b = fake_shard([12], seed=0), fake_shard([12], seed=0)
    b["aux"][9:] = torch.randn(3, 3, H).to(torch.bfloat16)
    b["input_ids"][10:] = (b["input_ids"][10:] + 1) % V
    out_a, out_b = outputs(model, a, [0]), outputs(model, b, [0])
    for j in range(3):
        # Step j at position t reads tokens up to t+1+j: positions t <= 8-j are untouched by the change.
        torch.testing.assert_close(out_a[j][: 9 - j], out_b[j][: 9 - j])
        assert not torch.allclose(out_a[j][9:], out_b[j][9:])


def test_checkpoint_has_the_serving_names_and_round_trips(tmp_path):
    model = tiny_draft()
    save_checkpoint(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    }
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == VD and config["vocab_size"] == V and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["rope_theta"] == 10000.0 and config["tie_word_embeddings"] is False
    loaded = load_checkpoint(tmp_path)
    assert loaded.midlayer.self_attn.q_proj.weight.shape == (32, 2 * H)
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    torch.testing.assert_close(loaded.fc.weight, model.fc.weight.to(torch.bfloat16).float())


def test_plan_respects_token_budget_and_order():
    cu = torch.tensor([0, 5, 9, 20, 22])
    assert plan(cu, 10, [3, 0, 1, 2]) == [[3, 0], [1], [2]]


def test_tau_and_per_position_from_accepted_lengths():
    result = summarise(torch.tensor([0, 1, 3, 3]), 3)
    assert result["per_position"] == [0.75, 0.5, 0.5]
    assert result["tau"]["1"] == 1.75 and result["tau"]["3"] == 1 + 7 / 4


def test_training_speed_benchmark_runs_both_precisions_on_the_same_start():
    """python -m eaglepipe.bench_train at a tiny shape: one line per precision from the same weights and batch, whose
    first-step losses agree (the bf16 path computes the same objective)."""
    from eaglepipe import bench_train

    fp32, bf16 = bench_train.main(["--preset", "tiny", "--device", "cpu", "--tokens", "128", "--seq-len", "32",
                                   "--ttt-steps", "2", "--steps", "1", "--draft-vocab", "256"])
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert fp32["tok_s"] > 0 and bf16["tok_s"] > 0
    assert fp32["first_loss"] > 0 and abs(bf16["first_loss"] - fp32["first_loss"]) < 1e-3 * fp32["first_loss"]
