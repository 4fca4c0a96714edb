"""The training options a draft variant can set (train.schedule, loss, optimizer, select), on small real tensors."""

import copy
import math

import pytest
import torch

from eaglepipe import config as cfg
from eaglepipe import train
from test_draft import VD, H, packed_inputs, tiny_draft


def test_schedules_warm_up_then_decay_to_a_tenth_or_hold():
    lr, total, warmup = 1e-3, 110, 10
    for schedule in train.SCHEDULES:
        assert [train.lr_at(s, total, lr, warmup, schedule) for s in range(warmup)] == \
            pytest.approx([lr * (s + 1) / warmup for s in range(warmup)])
        assert train.lr_at(warmup, total, lr, warmup, schedule) == pytest.approx(lr)
    assert train.lr_at(total, total, lr, warmup, "cosine") == pytest.approx(0.1 * lr)
    assert train.lr_at(total, total, lr, warmup, "linear") == pytest.approx(0.1 * lr)
    assert train.lr_at(60, total, lr, warmup, "linear") == pytest.approx(0.55 * lr)  # half-way: half the way down
    assert train.lr_at(60, total, lr, warmup, "cosine") == pytest.approx(0.55 * lr)  # cos(pi/2) = 0
    assert train.lr_at(35, total, lr, warmup, "cosine") > train.lr_at(35, total, lr, warmup, "linear")
    assert {train.lr_at(s, total, lr, warmup, "constant") for s in range(warmup, total)} == {lr}
    # The default is the schedule the recipe always had (bytes of existing drafts unchanged).
    old = [lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((s - warmup) / (total - warmup), 1.0))))
           for s in range(warmup, total)]
    assert [train.lr_at(s, total, lr, warmup) for s in range(warmup, total)] == old
    with pytest.raises(ValueError, match="config key train.schedule: 'step'"):
        train.lr_at(20, total, lr, warmup, "step")


def test_lk_loss_is_the_papers_hybrid_of_cross_entropy_and_acceptance():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VD, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(6, VD, generator=g, dtype=torch.float64), -1) * 0.9  # 10 % outside the vocab
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(target, q).sum(-1)
    ce = -(target * torch.log(q)).sum(-1)
    lam = torch.exp(-3.0 * alpha.detach())
    value = train.row_losses(logits, target, "lk")
    torch.testing.assert_close(value, lam * ce + (1 - lam) * (1 - alpha))
    torch.testing.assert_close(train.row_losses(logits, target, "soft_ce"), ce)
    # lambda is held constant: the gradient is lambda * dCE + (1 - lambda) * d(1 - alpha)
    (grad,) = torch.autograd.grad(value.sum(), logits)
    (d_ce,) = torch.autograd.grad(ce.sum(), logits, retain_graph=True)
    (d_tv,) = torch.autograd.grad((1 - alpha).sum(), logits)
    torch.testing.assert_close(grad, lam[:, None] * d_ce + (1 - lam[:, None]) * d_tv)
    # A draft equal to the target on a full-mass row accepts everything: the acceptance term vanishes.
    p = torch.softmax(torch.randn(1, VD, generator=g, dtype=torch.float64), -1)
    exact = train.row_losses(torch.log(p), p, "lk")
    torch.testing.assert_close(exact, math.exp(-3.0) * -(p * torch.log(p)).sum(-1))
    with pytest.raises(ValueError, match="config key train.loss: 'kl'"):
        train.row_losses(logits, target, "kl")


def test_chunked_lk_loss_equals_the_per_step_lk_loss():
    """train.Objective with loss lk: the chunked path (several chunks) == the reference path in value, per-step
    statistics and every gradient, float64."""
    from eaglepipe.batches import targets

    batch, embed = packed_inputs([9, 4, 13, 6], 3, torch.float64)
    batch.loss_mask[:3] = False
    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    results = []
    for path in ("reference", "chunked"):
        model = tiny_draft().double()
        probs, valid = targets(batch, head, model.t2d)
        objective = train.Objective(model, path=path, loss="lk")
        saved, train.CHUNK_ELEMENTS = train.CHUNK_ELEMENTS, VD * 7
        try:
            value, stats = objective(batch, embed, probs, valid, [float(c) for c in batch.step_counts], 0.8, 2.0)
        finally:
            train.CHUNK_ELEMENTS = saved
        value.backward()
        results.append((value, stats, {n: p.grad for n, p in model.named_parameters()}))
    (v_ref, s_ref, g_ref), (v_new, s_new, g_new) = results
    torch.testing.assert_close(v_new, v_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s_new, s_ref, rtol=1e-6, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g_new[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


def _steps(opt, model, batch, embed, probs, valid, n):
    objective = train.Objective(model)
    losses = []
    for _ in range(n):
        opt.zero_grad()
        value, _ = objective(batch, embed, probs, valid, [float(c) for c in batch.step_counts], 0.8, 1.0)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return losses


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without torch.optim.Muon")
def test_muon_takes_the_matrices_adamw_the_rest_and_resumes_exactly():
    from eaglepipe.batches import targets

    batch, embed = packed_inputs([20, 9, 31], 3, torch.float32)
    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5))
    model = tiny_draft()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = train.optimizer(params, torch.device("cpu"), "muon", head=model.lm_head.weight, lr=1e-3, weight_decay=0.0)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {id(p) for p in params if p.ndim == 2 and p is not model.lm_head.weight}
    assert in_adamw == {id(p) for p in params} - in_muon and id(model.lm_head.weight) in in_adamw
    probs, valid = targets(batch, head, model.t2d)
    losses = _steps(opt, model, batch, embed, probs, valid, 3)
    assert losses[-1] < losses[0]
    # A checkpoint of weights and both optimizers' state continues exactly as the uninterrupted run.
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    after = _steps(opt, model, batch, embed, probs, valid, 2)
    model.load_state_dict(saved[0])
    again = train.optimizer([p for p in model.parameters() if p.requires_grad], torch.device("cpu"), "muon",
                            head=model.lm_head.weight, lr=1e-3, weight_decay=0.0)
    again.load_state_dict(saved[1])
    assert _steps(again, model, batch, embed, probs, valid, 2) == after
    with pytest.raises(ValueError, match="config key train.optimizer: 'sgd'"):
        train.optimizer(params, torch.device("cpu"), "sgd", lr=1e-3)


CUS = [torch.tensor([0, 5, 9, 20, 22, 30, 41, 50, 52, 60, 64]), torch.tensor([0, 7, 8, 15]), torch.tensor([0, 4])]


def settings(**kw):
    return {"seed": 0, "epochs": 2, "max_batch_tokens": 16, "select_fraction": 0.2, **kw}


def test_held_back_slice_is_seeded_disjoint_from_training_and_never_trained_on():
    held = train.held_back(CUS, settings(select="tau"))
    assert [len(h) for h in held] == [2, 1, 0]  # a fifth of 10, at least one of 3, never a shard's only sequence
    assert train.held_back(CUS, settings(select="tau")) == held
    assert train.held_back(CUS, settings(select="tau", seed=1)) != held
    assert train.held_back(CUS, settings(select="last")) is None
    kept = train.kept_sequences(CUS, settings(select="tau"))
    for s, cu in enumerate(CUS):
        assert sorted(kept[s] + held[s]) == list(range(cu.numel() - 1))
    trained = {(s, i) for _, s, seqs in train.schedule(CUS, settings(select="tau")) for i in seqs}
    assert trained == {(s, i) for s, k in enumerate(kept) for i in k}
    # with a data fraction too, the held-back slice stays out and the fraction is of the rest
    half = train.kept_sequences(CUS, settings(select="tau", data_fraction=0.5))
    assert [len(k) for k in half] == [4, 1, 1] and all(not set(k) & set(h) for k, h in zip(half, held, strict=True))
    # select: last keeps today's order and subsets
    assert train.schedule(CUS, settings(select="last")) == train.schedule(CUS, settings())
    assert train.kept_sequences(CUS, settings(select="last", data_fraction=0.5)) == \
        train.kept_sequences(CUS, settings(data_fraction=0.5))
    with pytest.raises(ValueError, match="config key train.select: tau"):
        train.held_back([torch.tensor([0, 4])], settings(select="tau"))


@pytest.mark.parametrize("overrides, message", [
    ({"loss": "kl"}, "config key train.variants.v.loss: 'kl' is not one of"),
    ({"lr": 0}, "config key train.variants.v.lr: 0 is less than or equal to the minimum"),
    ({"gpus": 2}, "config key train.variants.v.gpus: a scheduling key applies to every variant"),
    ({"variants": {}}, "config key train.variants.v.variants: not a train key a variant can set"),
])
def test_bad_variant_keys_are_named(overrides, message):
    config = cfg.validate({"train": {"variants": {"v": overrides}}})
    with pytest.raises(cfg.ConfigError, match=message):
        cfg.variant_settings(config)


def test_variant_settings_are_the_recipe_with_the_overrides_and_no_scheduling_keys():
    config = cfg.validate({"train": {"lr": 2e-3, "threads": 4, "variants": {"b": {"ttt_decay": 0.5}, "a": {}}}})
    settings = cfg.variant_settings(config)
    assert list(settings) == ["a", "b"]  # by name: the order of the comparison and of ties
    assert settings["a"] == cfg.output_settings(config, "train") and "variants" not in settings["a"]
    assert settings["b"] == {**settings["a"], "ttt_decay": 0.5} and settings["b"]["lr"] == 2e-3
    assert not {"threads", "gpus", "processes", "checkpoint_every"} & settings["a"].keys()


def test_fc_norm_norms_each_aux_layer_before_fc_and_round_trips_in_vllms_names(tmp_path):
    from eaglepipe.batches import collate, step_inputs
    from eaglepipe.draft import DraftConfig, Eagle3Draft, load_checkpoint, save_checkpoint
    from test_draft import V, fake_shard

    target = {"hidden_size": H, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "vocab_size": V, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
    assert "fc_norm" not in DraftConfig.from_target(target, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3]).to_hf()
    config = DraftConfig.from_target(target, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3], fc_norm=True)
    assert config.to_hf()["fc_norm"] is True and DraftConfig.from_hf(config.to_hf()) == config
    torch.manual_seed(0)
    model = Eagle3Draft(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    plain = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3]))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("fc_norm.")})

    shard = fake_shard([7, 5])
    batch = collate(shard, [0, 1], 10_000, torch.float32, "cpu")
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(1))

    def first_step(m, aux):
        with torch.no_grad():
            return next(m.unroll(aux, step_inputs(batch, 1, embed), batch.positions, batch.packing))

    chunks = batch.aux.chunk(3, -1)
    normed = torch.cat([c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * model.fc_norm[i].weight
                        for i, c in enumerate(chunks)], -1)
    torch.testing.assert_close(first_step(model, batch.aux), first_step(plain, normed))
    # each layer normed on its own: one layer's scale does not change the draft
    scaled = torch.cat([chunks[0] * 50, chunks[1], chunks[2]], -1)
    torch.testing.assert_close(first_step(model, scaled), first_step(model, batch.aux), rtol=1e-4, atol=1e-5)
    save_checkpoint(model, tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(f.keys())
    loaded = load_checkpoint(tmp_path)
    assert loaded.config.fc_norm
    torch.testing.assert_close(first_step(loaded, batch.aux), first_step(model.to(torch.bfloat16).float(), batch.aux))


def _chunked_loss_and_grads(batch, embed, head, compile, loss="soft_ce"):
    from eaglepipe.batches import targets

    model = tiny_draft()
    probs, valid = targets(batch, head, model.t2d)
    objective = train.Objective(model, compile=compile, loss=loss)
    saved, train.CHUNK_ELEMENTS = train.CHUNK_ELEMENTS, VD * 7  # 7 rows per chunk: the last chunk is shorter
    try:
        value, stats = objective(batch, embed, probs, valid, [float(c) for c in batch.step_counts], 0.8, 1.0)
    finally:
        train.CHUNK_ELEMENTS = saved
    value.backward()
    return value.detach(), stats, {n: p.grad for n, p in model.named_parameters()}


def _tensor_inputs(graph) -> list[torch.Tensor]:
    inputs = [node.meta["example_value"] for node in graph.graph.nodes if node.op == "placeholder"]
    return [t for t in inputs if isinstance(t, torch.Tensor)]


def test_compiled_steps_trace_once_with_only_the_token_axis_symbolic_and_equal_eager():
    """train.compile as torch.compile sees it (a backend that records each graph and runs it as traced): the soft
    cross-entropy and the layer's elementwise steps (norm, rotation of q and of k, SiLU x up) each traced whole once,
    then two batches of other sizes and the loss's shorter last chunks compile nothing new; only the row (token) axis
    is symbolic; loss, statistics and every gradient equal the eager path's."""
    torch._dynamo.reset()
    graphs, after_first = [], None

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5))
    for lengths in ([9, 4, 13, 6], [20, 9, 31], [5, 3]):
        batch, embed = packed_inputs(lengths, 3, torch.float32)
        got, ref = (_chunked_loss_and_grads(batch, embed, head, b) for b in (backend, None))
        after_first = after_first or len(graphs)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-5)
        for name in ref[2]:
            torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-5, atol=1e-7, msg=name)
    assert len(graphs) == after_first, f"{len(graphs) - after_first} graphs more: a new batch size recompiled"
    loss = [g for g in graphs if any("logsumexp" in str(node.target) for node in g.graph.nodes)]
    assert len(loss) == 1
    tensors = _tensor_inputs(loss[0])
    assert len(tensors) == 4 and all(isinstance(t.shape[0], torch.SymInt) for t in tensors)
    assert all(isinstance(n, int) for t in tensors for n in t.shape[1:])
    steps = {getattr(node.target, "__name__", node.target) for g in graphs if g not in loss for node in g.graph.nodes
             if node.op in ("call_function", "call_method")}
    assert {"rsqrt", "silu", "cos", "sin"} <= steps, steps
    for graph in graphs:
        tokens = _tensor_inputs(graph)[0]  # every step's first input is token-major
        assert isinstance(tokens.shape[0], torch.SymInt) and all(isinstance(n, int) for n in tokens.shape[1:])


@pytest.mark.parametrize("loss", train.LOSSES)
def test_compiled_loss_by_inductor_equals_eager(loss):
    """The same through inductor, as train.compile runs it (on a CPU: generated C++), for each loss."""
    torch._dynamo.reset()
    head = torch.randn(VD, H, generator=torch.Generator().manual_seed(5))
    batch, embed = packed_inputs([9, 4, 13, 6], 3, torch.float32)
    got, ref = (_chunked_loss_and_grads(batch, embed, head, b, loss) for b in ("inductor", None))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_held_back_scoring_runs_the_steps_eager_and_leaves_them_compiled():
    """train.select: tau scores the held-back slice during training: under no_grad in float32, which would add
    compiled entries towards torch.compile's recompile limit (a hard error under fullgraph); eager_steps runs that
    scoring eager and gives the training its compiled steps back."""
    torch._dynamo.reset()
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    from eaglepipe.batches import step_inputs
    from eaglepipe.draft import EAGER

    batch, embed = packed_inputs([9, 4, 13, 6], 3, torch.float32)
    model = tiny_draft()
    model.compile_steps(backend)
    compiled = model.kernels
    with model.eager_steps(), torch.no_grad():
        assert model.midlayer.mlp.kernels is EAGER and model.midlayer.input_layernorm.kernels is EAGER
        list(model.unroll(batch.aux, step_inputs(batch, 3, embed), batch.positions, batch.packing))
    assert not graphs, "the scoring compiled"
    assert model.kernels is compiled and model.midlayer.self_attn.kernels is compiled
