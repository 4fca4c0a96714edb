"""Offline acceptance figures (eaglepipe/evaluate.py) on a tiny real target of six tokens: the expected acceptance at
T > 0 against a brute-force enumeration, position buckets and the per-request mean against their definitions."""

import itertools

import pytest
import torch

from eaglepipe.batches import collate, step_inputs
from eaglepipe.draft import DraftConfig, Eagle3Draft
from eaglepipe.evaluate import POSITION_BUCKETS, figures, score
from eaglepipe.formats import write_hidden_shard

V, H, K = 6, 32, 3
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def world():
    """A tiny random Llama target with a six-token vocabulary and an untrained draft over the same vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=8192, tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    draft = Eagle3Draft(DraftConfig.from_target(config.to_dict(), draft_vocab_size=V, aux_layer_ids=LAYERS))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    draft.t2d[:] = True  # draft token i is target token i (d2t all zero)
    return target, draft.eval()


def shard_of(target, lengths, prompt=4, seed=0) -> dict:
    """A hidden-state shard of random token sequences (the first `prompt` tokens of each are the prompt), states
    from the target itself: aux the inputs of LAYERS, final the input of its lm_head."""
    g = torch.Generator().manual_seed(seed)
    ids, aux, final, mask = [], [], [], []
    seen = {}
    hook = target.lm_head.register_forward_hook(lambda m, args, out: seen.update(final=args[0][0]))
    for n in lengths:
        x = torch.randint(0, V, (n,), generator=g)
        with torch.no_grad():
            out = target(x[None], output_hidden_states=True)
        ids.append(x)
        aux.append(torch.stack([out.hidden_states[k][0] for k in LAYERS], 1))
        final.append(seen["final"])
        mask.append((torch.arange(n) >= prompt).to(torch.uint8))
    hook.remove()
    return {"input_ids": torch.cat(ids).int(), "loss_mask": torch.cat(mask),
            "cu_seqlens": torch.tensor([0] + lengths).cumsum(0), "aux": torch.cat(aux).bfloat16(),
            "final": torch.cat(final).bfloat16()}


def write(tmp_path, shard, ids, name="s") -> list[str]:
    path = tmp_path / f"{name}.safetensors"
    write_hidden_shard(path, shard, {"ids": ids})
    return [str(path)]


def test_expected_acceptance_equals_a_brute_force_enumeration(tmp_path, world):
    """tau at T from evaluate equals the mean, over every start, of E[1 + min(accepted, k)] enumerated over all V^k
    token sequences the target emits (vLLM's rejection sampler emits a token distributed as the target's at T, equal
    to the proposal exactly when it accepts it), with the draft's proposals and the target's probabilities computed
    here on their own."""
    target, draft = world
    lengths = [17, 23]
    shard = shard_of(target, lengths)
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    temperatures = [0.7, 1.5]
    result = score(draft, write(tmp_path, shard, ["a", "b"]), embed, K, 64, head=head, temperatures=temperatures)

    batch = collate(shard, [0, 1], 64, torch.float32, "cpu")
    with torch.no_grad():
        outs = [draft.lm_head(o[0])
                for o in draft.unroll(batch.aux, step_inputs(batch, K, embed), batch.positions, batch.packing)]
    proposals = torch.stack([o.argmax(-1) for o in outs], 1)  # [T, K] (d2t is the identity)
    for t in temperatures:
        expected, starts = {k: 0.0 for k in range(1, K + 1)}, 0
        for a, n in zip(shard["cu_seqlens"].tolist(), lengths):
            for i in range(a + 4 - 2, a + n - 1 - K):  # first drafted token i+2 in the response, all K inside
                probs = [torch.softmax(target.lm_head(shard["final"][i + 1 + j].float()).detach().double() / t, -1)
                         for j in range(K)]
                starts += 1
                for emitted in itertools.product(range(V), repeat=K):
                    weight = 1.0
                    for j, y in enumerate(emitted):
                        weight *= float(probs[j][y])
                    accepted = 0
                    while accepted < K and emitted[accepted] == int(proposals[i, accepted]):
                        accepted += 1
                    for k in expected:
                        expected[k] += weight * min(accepted, k)
        got = result["temperatures"][str(t)]
        assert got["positions"] == starts == result["positions"]
        for k in expected:
            assert got["tau"][str(k)] == pytest.approx(1 + expected[k] / starts, abs=1e-5), (t, k)
        assert 1.0 < got["tau"]["1"] < got["tau"][str(K)]  # non-trivial: some acceptance, more with more drafts
    low, high = (result["temperatures"][str(t)]["tau"][str(K)] for t in temperatures)
    assert low != high


def test_position_buckets_sum_back_to_the_overall_tau(tmp_path, world):
    """by_position: every start in the bucket of its first drafted token's position, bucket counts as counted by
    hand, and the buckets' tau weighted by their counts give the overall tau, greedy and at T = 0.7."""
    target, draft = world
    lengths = [4400, 700]
    shard = shard_of(target, lengths, seed=1)
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    result = score(draft, write(tmp_path, shard, ["long", "short"]), embed, K, 4400, head=head, temperatures=[0.7])
    edges = list(POSITION_BUCKETS) + [1 << 30]
    for figs in (result, result["temperatures"]["0.7"]):
        buckets = figs["by_position"]
        assert [(b["from"], b["to"]) for b in buckets] == list(zip(POSITION_BUCKETS,
                                                                     list(POSITION_BUCKETS[1:]) + [None]))
        for b, lo, hi in zip(buckets, edges, edges[1:]):
            # first drafted positions p = t + 2 run over [4, n - K] in a sequence of n tokens with a 4-token prompt
            assert b["positions"] == sum(max(0, min(hi, n - K + 1) - max(lo, 4)) for n in lengths)
        assert sum(b["positions"] for b in buckets) == figs["positions"]
        assert all(b["positions"] > 0 for b in buckets)
        for k in range(1, K + 1):
            pooled = sum(b["positions"] * (b["tau"][str(k)] - 1) for b in buckets) / figs["positions"] + 1
            assert pooled == pytest.approx(figs["tau"][str(k)], rel=1e-12)
            assert figs["tau"][str(k)] > 1.0


def test_request_mean_is_the_mean_of_each_conversations_own_tau(tmp_path, world):
    """tau_request_mean is the unweighted mean of the tau each conversation gets scored alone; tau (pooled over
    starts) weights the long one more, so the two differ; an id in two shards is one request."""
    target, draft = world
    lengths = [60, 15, 30]
    shard = shard_of(target, lengths, seed=2)
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    ids = ["x", "y", "z"]
    whole = score(draft, write(tmp_path, shard, ids), embed, K, 64, head=head, temperatures=[0.7])
    alone = []
    for n, (i, length) in enumerate(zip(ids, lengths)):
        a, b = int(shard["cu_seqlens"][n]), int(shard["cu_seqlens"][n + 1])
        part = {k: v[a:b] for k, v in shard.items() if k != "cu_seqlens"} | {"cu_seqlens": torch.tensor([0, length])}
        alone.append(score(draft, write(tmp_path, part, [i], i), embed, K, 64, head=head, temperatures=[0.7]))
    for figs, own in ((whole, alone), (whole["temperatures"]["0.7"], [r["temperatures"]["0.7"] for r in alone])):
        assert figs["requests"] == 3
        for k in map(str, range(1, K + 1)):
            assert figs["tau_request_mean"][k] == pytest.approx(sum(r["tau"][k] for r in own) / 3, rel=1e-12)
        assert figs["tau_request_mean"] != figs["tau"]
    # the same conversation id in a second shard (another turn of it) stays one request
    split = score(draft, write(tmp_path, shard, ["x", "y", "x"], "again"), embed, K, 64)
    assert split["requests"] == 2


def test_figures_of_an_empty_split_are_defined():
    empty = figures(torch.zeros(0, K, dtype=torch.float64), torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.int64))
    assert empty["positions"] == 0 and empty["requests"] == 0 and empty["tau"]["1"] == 1.0
    assert [b["positions"] for b in empty["by_position"]] == [0] * len(POSITION_BUCKETS)


def test_summary_and_position_plot_name_both_means_and_every_temperature(tmp_path, world):
    """The summary's acceptance section names the pooled and the per-request tau, gives tau at T = 0 and each
    evaluate temperature and a row per position bucket; the position plot is a PNG, the same bytes when redrawn."""
    from eaglepipe import plots, report

    target, draft = world
    shard = shard_of(target, [600, 40], seed=4)
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    acc = score(draft, write(tmp_path, shard, ["a", "b"]), embed, K, 1024, head=head, temperatures=[0.7])
    text = "\n".join(report.acceptance_section(acc))
    assert "tau, pooled over verify steps" in text and "tau, mean over requests" in text
    assert f"| 3 | {acc['tau']['3']:.3f} | {acc['tau_request_mean']['3']:.3f} |" in text
    t07 = acc["temperatures"]["0.7"]
    assert "T = 0.7 pooled" in text and f"{t07['tau']['3']:.3f} | {t07['tau_request_mean']['3']:.3f}" in text
    first, second = acc["by_position"][:2]
    assert f"| 0-512 | {first['positions']} | {first['tau']['3']:.3f} |" in text
    assert f"| 512-1K | {second['positions']} |" in text and "| 4K+ | 0 | - | - |" in text
    old = {k: v for k, v in acc.items() if k not in ("tau_request_mean", "requests", "temperatures", "by_position")}
    assert "mean over requests" not in "\n".join(report.acceptance_section(old))  # a bundle's older acceptance.json
    (tmp_path / "acceptance.json").write_text(__import__("json").dumps(acc))
    plots.positions(tmp_path / "acceptance.json", tmp_path / "a.png")
    plots.positions(tmp_path / "acceptance.json", tmp_path / "b.png")
    png = (tmp_path / "a.png").read_bytes()
    assert png.startswith(b"\x89PNG") and png == (tmp_path / "b.png").read_bytes()


def test_the_walk_counts_the_verify_steps_greedy_serving_takes():
    """Accepted lengths at starts 10..15 of one conversation (2, 0, 0, 1, 0, 0) and at 3..4 of another (1, 1): at
    k = 1 the steps are at 10, 12, 13, 15 and 3 (3 accepted in 5 steps); at k = 2 at 10, 13, 15 and 3 (4 in 4)."""
    from eaglepipe.evaluate import walk

    lengths = torch.tensor([2, 0, 0, 1, 0, 0, 1, 1])
    owners = torch.tensor([0] * 6 + [1] * 2)
    positions = torch.tensor([10, 11, 12, 13, 14, 15, 3, 4])
    tau = walk(lengths, owners, positions, 2)
    assert tau == {"1": 1 + 3 / 5, "2": 1 + 4 / 4}
    every = 1 + lengths.clamp(max=1).float().mean().item()  # pooled over every start: another figure
    assert tau["1"] != pytest.approx(every)
