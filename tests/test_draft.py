import json

import pytest
import torch

from eaglepipe.batches import collate, pack, step_inputs
from eaglepipe.draft import DraftConfig, Eagle3Draft, load_checkpoint, save_checkpoint
from eaglepipe.evaluate import summarise, survival

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


def test_pack_respects_token_budget_and_order():
    cu = torch.tensor([0, 5, 9, 20, 22])
    assert pack(cu, 10, [3, 0, 1, 2]) == [[3, 0], [1], [2]]


def test_tau_and_per_position_from_accepted_lengths():
    result = summarise(survival(torch.tensor([0, 1, 3, 3]), 3))
    assert result["per_position"] == [0.75, 0.5, 0.5]
    assert result["tau"]["1"] == 1.75 and result["tau"]["3"] == 1 + 7 / 4


def test_training_benchmark_reports_new_path_reference_and_baseline(tmp_path):
    """python -m eaglepipe.tools.bench_train at a tiny shape: the new path's first-step loss agrees with the float32
    reference, its first-step gradient with the naive baseline's, and the JSON carries the figures the README cites."""
    from eaglepipe.tools import bench_train

    out = tmp_path / "bench.json"
    summary = bench_train.main(["--preset", "tiny", "--device", "cpu", "--tokens", "128", "--seq-len", "32",
                                "--ttt-steps", "2", "--steps", "1", "--draft-vocab", "256", "--json", str(out)])
    r = summary["presets"]["tiny"]
    assert r["tok_s"] > 0 and r["baseline_tok_s"] > 0 and r["flop_per_token"] > 0
    assert r["loss_ok"] and r["grad_ok"], r
    assert 0 < r["grad_gap_new_to_fp32"] < 0.1 and 0 < r["grad_gap_naive_to_fp32"] < 0.1, r
    written = json.loads(out.read_text())
    for key in ("device", "command", "mfu", "flop_per_token", "tok_s", "peak_gib", "peak_bytes_per_token",
                "baseline_tok_s", "loss_new", "loss_reference", "startup_s"):
        assert key in written, key
    assert 0 < r["startup_s"] < 60


def test_training_benchmark_measures_the_compiled_loss_and_profiles_a_step():
    """--compile: the new path again with the compiled loss in the same run, its loss within tolerance of the
    float32 reference's and a ratio to eager; --profile N: N operators of a step by self time, largest first."""
    from eaglepipe.tools import bench_train

    summary = bench_train.main(["--preset", "tiny", "--device", "cpu", "--tokens", "128", "--seq-len", "32",
                                "--ttt-steps", "2", "--steps", "1", "--draft-vocab", "256", "--no-baseline",
                                "--compile", "--profile", "4"])
    r = summary["presets"]["tiny"]
    compiled = r["compiled"]
    assert compiled["loss_ok"] and compiled["tok_s"] > 0 and compiled["startup_s"] > 0, compiled
    assert compiled["speedup_over_eager"] == pytest.approx(compiled["tok_s"] / r["tok_s"])
    rows = r["profile"]
    assert len(rows) == 4 and all(row["calls"] >= 1 and row["name"] for row in rows), rows
    assert [row["self_ms"] for row in rows] == sorted((row["self_ms"] for row in rows), reverse=True)


def test_training_benchmark_times_speculators_step_beside_ours():
    """--anchor: speculators' own training step (its model, loss, Muon and clipping; setup.sh installs speculators
    0.9.0) at the same draft shape and batch in the same run, and speculators_ratio, our fastest path over it."""
    pytest.importorskip("speculators.models.eagle3", reason="bash setup.sh installs speculators 0.9.0")
    from eaglepipe.tools import bench_train

    summary = bench_train.main(["--preset", "tiny", "--device", "cpu", "--tokens", "128", "--seq-len", "32",
                                "--ttt-steps", "2", "--steps", "1", "--draft-vocab", "256", "--no-baseline",
                                "--anchor"])
    r = summary["presets"]["tiny"]
    anchor = r["anchor"]
    assert anchor["trainer"] == "speculators 0.9.0" and anchor["tok_s"] > 0 and anchor["startup_s"] > 0, anchor
    assert r["speculators_ratio"] == pytest.approx(r["tok_s"] / anchor["tok_s"])


def test_new_training_path_in_float32_has_the_reference_gradient():
    """The benchmark's float32 yardstick: without autocast the new path (flex/merged attention, chunked soft CE)
    and the reference path (dense attention, per-step full logits) give the same first-step gradient, so what
    separates their bf16 gradients is rounding."""
    from eaglepipe.tools import bench_train

    target = bench_train.PRESETS["tiny"]
    config = bench_train.DraftConfig.from_target(target, draft_vocab_size=256, aux_layer_ids=[2, 4, 5])
    device = torch.device("cpu")
    batch, _ = bench_train.synthetic_batch(config, 96, 32, device, 0, 3)
    new = bench_train.measure(config, device, batch, 3, 1, 0, precision="fp32", keep_grad=True)
    reference = bench_train.reference_grad(config, device, batch, 3, 0)
    assert bench_train.relative_gap(new["grad"], reference) < 1e-5


def packed_inputs(lengths, steps, dtype, seed=0):
    shard = fake_shard(lengths, seed)
    batch = collate(shard, list(range(len(lengths))), 10_000, dtype, "cpu",
                    t2d=torch.ones(V, dtype=torch.bool), steps=steps)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return batch, embed


def test_merged_attention_equals_the_dense_formulation_in_values_and_gradients():
    """Context by log-sum-exp plus merged diagonal entries == the original [T, T + steps] softmax, float64, on a
    packed batch of several documents over four unroll steps: outputs of every step and every parameter gradient."""
    batch, embed = packed_inputs([9, 4, 13, 1, 6], 4, torch.float64)
    results = []
    for impl in ("dense", "merged"):
        model = tiny_draft().double()
        model.attention = impl
        outs = list(model.unroll(batch.aux, step_inputs(batch, 4, embed), batch.positions, batch.packing))
        sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(j), dtype=o.dtype)).sum()
            for j, o in enumerate(outs)).backward()
        results.append((outs, {n: p.grad for n, p in model.named_parameters()}))
    (dense, gd), (merged, gm) = results
    # The norms and the rope compute in float32 (as served), so float64 agreement is float32 rounding, amplified
    # through four steps: ~1e-7. A missing or misplaced attention entry changes values by 1e-2 or more.
    for a, b in zip(dense, merged):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name in gd:
        torch.testing.assert_close(gm[name], gd[name], rtol=1e-5, atol=1e-6, msg=name)


def test_flex_context_matches_the_dense_context_with_padding_and_documents():
    """The CUDA path's context attention (flex_attention with the document-causal block mask, the row padded to
    the block size) gives the dense path's output and log-sum-exp; checked with eager flex_attention (forward)."""
    from eaglepipe.draft import dense_context, flex_context

    batch, _ = packed_inputs([50, 7, 130, 3, 10], 1, torch.float32)  # 200 tokens: padded to 256
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, batch.tokens, 8, generator=g) for _ in range(3))
    out_f, lse_f = flex_context(q, k, v, batch.packing, 0.3)
    out_d, lse_d = dense_context(q, k, v, batch.mask, 0.3)
    torch.testing.assert_close(lse_f, lse_d, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_f, out_d, rtol=1e-5, atol=1e-5)


def test_chunked_soft_cross_entropy_equals_the_per_step_loss():
    """train.Objective's chunked loss (several chunks) == the reference per-step log_softmax loss: value, per-step
    statistics and gradients, float64."""
    from eaglepipe import train
    from eaglepipe.batches import targets

    batch, embed = packed_inputs([9, 4, 13, 6], 3, torch.float64)
    batch.loss_mask[:3] = False  # prompt positions: fewer rows at some steps
    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    results = []
    for loss in ("reference", "chunked"):
        model = tiny_draft().double()
        probs, valid = targets(batch, head, model.t2d)
        objective = train.Objective(model, path=loss)
        saved, train.CHUNK_ELEMENTS = train.CHUNK_ELEMENTS, VD * 7  # 7 rows per chunk
        try:
            value, stats = objective(batch, embed, probs, valid, [float(c) for c in batch.step_counts], 0.8, 2.0)
        finally:
            train.CHUNK_ELEMENTS = saved
        value.backward()
        results.append((value, stats, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, s_ref, g_ref), (v_new, s_new, g_new) = results
    # Both take logits and softmax in float32 (as under autocast), in another order: agreement is float32 rounding.
    torch.testing.assert_close(v_new, v_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s_new, s_ref, rtol=1e-6, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g_new[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_training_steps_of_the_new_path_follow_the_original_path():
    """Five AdamW steps, float32: the new path (merged attention, chunked loss) and the original one (dense
    attention, per-step loss) give the same losses within 1e-5 relative."""
    from eaglepipe import train
    from eaglepipe.batches import targets

    batch, embed = packed_inputs([20, 9, 31], 3, torch.float32)
    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5))
    losses = {}
    for impl, loss in (("dense", "reference"), ("merged", "chunked")):
        model = tiny_draft()
        model.attention = impl
        params = [p for p in model.parameters() if p.requires_grad]
        opt = train.optimizer(params, torch.device("cpu"), lr=1e-3)
        objective = train.Objective(model, path=loss)
        probs, valid = targets(batch, head, model.t2d)
        losses[impl] = []
        for _ in range(5):
            opt.zero_grad()
            value, _ = objective(batch, embed, probs, valid, [float(c) for c in batch.step_counts], 0.8, 1.0)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            losses[impl].append(float(value))
    gaps = [abs(a - b) / a for a, b in zip(losses["dense"], losses["merged"])]
    assert losses["dense"][-1] < losses["dense"][0] and max(gaps) < 1e-5, losses


def test_per_sequence_counts_add_up_and_belong_to_their_sequence(tmp_path):
    """acceptance.json's by_sequence: each conversation's counts are what scoring it alone gives (so packing several
    into a batch, or splitting batches, assigns every start position to its own sequence), and the tau of all of
    them together is the overall tau."""
    from eaglepipe.evaluate import score, subset
    from eaglepipe.formats import write_hidden_shard

    model = tiny_draft().eval()
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    lengths = [9, 17, 6, 12]
    shard = fake_shard(lengths, seed=3)
    ids = ["b", "a", "d", "c"]
    write_hidden_shard(tmp_path / "all.safetensors", shard, {"ids": ids})
    whole = score(model, [str(tmp_path / "all.safetensors")], embed, max_k=3, max_tokens=24)
    assert sorted(whole["by_sequence"]) == sorted(ids)
    for n, (i, length) in enumerate(zip(ids, lengths)):
        a, b = int(shard["cu_seqlens"][n]), int(shard["cu_seqlens"][n + 1])
        alone = {k: v[a:b] for k, v in shard.items() if k != "cu_seqlens"}
        alone["cu_seqlens"] = torch.tensor([0, length])
        write_hidden_shard(tmp_path / f"{i}.safetensors", alone, {"ids": [i]})
        own = score(model, [str(tmp_path / f"{i}.safetensors")], embed, max_k=3, max_tokens=24)
        assert whole["by_sequence"][i] == own["by_sequence"][i]
        assert sum(own["by_sequence"][i]) == length - 2 - 3 + 1  # starts whose 3 drafted tokens are inside
    together = subset(whole, ids)
    assert together["positions"] == whole["positions"] and together["tau"] == whole["tau"]
    assert subset(whole, ["a"])["positions"] == sum(whole["by_sequence"]["a"])
    assert subset({"max_k": 3, "tau": {}}, ids) is None and subset(whole, ["unknown"]) is None


def test_outside_loops_leaves_out_the_starts_whose_first_draft_token_repeats_a_trailing_loop(tmp_path):
    """acceptance.json's outside_loops: a response that ends in a 4-token cycle has its repeats flagged (and only
    those, only in its last loss-mask span), the starts drafting into them are left out of its figures, and a shard
    without loops gives the overall figures."""
    from eaglepipe.evaluate import loop_tokens, score
    from eaglepipe.formats import write_hidden_shard

    model = tiny_draft().eval()
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    shard = fake_shard([40, 50], seed=5)
    cycle = torch.tensor([3, 1, 4, 1], dtype=torch.int32)
    shard["input_ids"][40 + 10:] = cycle.repeat(10)  # sequence 2: 10 free tokens, then the cycle to its end
    shard["input_ids"][40 + 9] = 2  # not part of the cycle
    shard["loss_mask"][40:45] = 0  # its prompt: the response span starts at 5
    flags = loop_tokens(shard)
    assert not flags[:40].any() and not flags[40:54].any() and flags[54:].all()  # repeats after the first cycle
    write_hidden_shard(tmp_path / "s.safetensors", shard, {"ids": ["free", "loops"]})
    result = score(model, [str(tmp_path / "s.safetensors")], embed, max_k=3, max_tokens=64)
    # starts t with t + 2 + 3 <= length and a response token at t + 2: 36 in the first; 43 (t = 3..45) in the second,
    # of which those with t + 2 >= 14 draft into the loop (34)
    assert result["positions"] == 36 + 43
    assert result["outside_loops"]["positions"] == 36 + 9
    assert result["outside_loops"]["starts_in_loops"] == 34 / 79
    free = {k: v[:40] for k, v in shard.items() if k != "cu_seqlens"} | {"cu_seqlens": torch.tensor([0, 40])}
    write_hidden_shard(tmp_path / "free.safetensors", free, {"ids": ["free"]})
    alone = score(model, [str(tmp_path / "free.safetensors")], embed, max_k=3, max_tokens=64)
    assert alone["outside_loops"]["tau"] == alone["tau"] and alone["outside_loops"]["starts_in_loops"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_batch_read_from_a_shard_equals_the_batch_gathered_from_it(tmp_path, dtype):
    """The training loop's batches: read_sequences copies each sequence's rows (cut to max_tokens) into one buffer and
    collate takes that buffer as it is; the batch equals collate gathering the same sequences from the whole shard
    (out of order, some cut), for every field, in bf16 and fp8 shards."""
    from eaglepipe.batches import read_sequences
    from eaglepipe.formats import encode, write_hidden_shard

    lengths = [9, 17, 6, 12, 20]
    shard = fake_shard(lengths, seed=4)
    for key in ("aux", "final"):
        shard[key], scale = encode(shard[key], dtype)
        if scale is not None:
            shard[f"{key}_scale"] = scale
    path = tmp_path / "shard.safetensors"
    write_hidden_shard(path, shard, {"ids": list("abcde")})
    seqs, max_tokens = [3, 0, 4, 1], 10
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::2] = True
    rows, local = read_sequences(path, seqs, max_tokens)
    assert local == [0, 1, 2, 3] and rows["cu_seqlens"].tolist() == [0, 10, 19, 29, 39]
    read = collate(rows, local, max_tokens, torch.float32, "cpu", t2d=t2d, steps=3)
    gathered = collate(shard, seqs, max_tokens, torch.float32, "cpu", t2d=t2d, steps=3)
    for name in ("input_ids", "loss_mask", "aux", "final", "positions", "seq_end", "doc", "valid", "step_rows",
                 "valid_rows", "step_of"):
        assert torch.equal(getattr(read, name), getattr(gathered, name)), name
    assert read.step_counts == gathered.step_counts
    # A subset of a read batch is gathered, not taken whole.
    part = collate(rows, [1, 3], max_tokens, torch.float32, "cpu")
    assert torch.equal(part.final, torch.cat([gathered.final[10:19], gathered.final[29:39]]))
