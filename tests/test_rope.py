"""The draft ropes exactly as vLLM (and transformers) do for the draft's exported config.json."""

import json
import math

import pytest
import torch

import tiny_targets
from conftest import snakemake, tiny_config
from eaglepipe import export
from eaglepipe.draft import DraftConfig, Eagle3Draft, load_checkpoint, save_checkpoint
from eaglepipe.rope import Rope, build, get_mscale, rotate_half

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 64
# The targets' rope keys as their published config.json files write them.
CASES = {
    "plain": {"rope_theta": 10000.0, "max_position_embeddings": 32768},
    # moonshotai/Kimi-K2-Instruct (DeepSeek-V3 architecture): beta_fast = beta_slow = 1 makes the ramp a step.
    "kimi-k2": {"rope_theta": 50000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}},
    # moonshotai/Kimi-K2-Instruct-0905: the same keys at factor 64.
    "kimi-k2-0905": {"rope_theta": 50000.0, "max_position_embeddings": 262144, "rope_scaling": {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}},
    # deepseek-ai/DeepSeek-V3: a real ramp (beta_fast 32, beta_slow 1).
    "deepseek-v3": {"rope_theta": 10000.0, "max_position_embeddings": 163840, "rope_scaling": {
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}},
    # Qwen-style yarn without mscale keys: cos and sin scaled by 1 + 0.1 ln 4.
    "yarn-no-mscale": {"rope_theta": 1000000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    # mscale != mscale_all_dim: the ratio of the two temperatures.
    "yarn-mscale-ratio": {"rope_theta": 10000.0, "max_position_embeddings": 65536, "rope_scaling": {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 0.5}},
    # meta-llama/Llama-3.1-8B.
    "llama3": {"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
    # No original_max_position_embeddings: filled from max_position_embeddings, as transformers' loader does.
    "yarn-no-original": {"rope_theta": 10000.0, "max_position_embeddings": 8192, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0}},
    # Phi-3 style: original_max_position_embeddings at the top level wins over max_position_embeddings.
    "yarn-top-level-original": {"rope_theta": 10000.0, "max_position_embeddings": 32768,
                                "original_max_position_embeddings": 4096, "rope_scaling": {
                                    "rope_type": "yarn", "factor": 8.0}},
    "linear": {"rope_theta": 10000.0, "max_position_embeddings": 8192,
               "rope_scaling": {"rope_type": "linear", "factor": 3.0}},
}
POSITIONS = torch.tensor([0, 1, 2, 31, 100, 1000, 4095, 4096, 4097, 8191, 12345, 16384, 19999, 20000])


def exported(tmp_path, target_rope: dict):
    """The draft built from a target with these rope keys, and the folder its checkpoint (config.json) is saved to."""
    target = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": 64, "rms_norm_eps": 1e-6,
              **target_rope}
    model = Eagle3Draft(DraftConfig.from_target(target, draft_vocab_size=32, aux_layer_ids=[1, 2, 3]))
    save_checkpoint(model, tmp_path)
    return model.midlayer.self_attn.rope, tmp_path


def ours(rope: Rope, q: torch.Tensor, k: torch.Tensor):
    """The trainer's rotation of vLLM-layout q [T, heads*d], k [T, kv*d]."""
    angles = rope.angles(POSITIONS.reshape(-1, 1), POSITIONS.device)  # [T, 1, d/2], as draft.Attention takes them

    def apply(x, heads):
        return rotate_half(x.view(len(POSITIONS), heads, HEAD_DIM), angles, rope.magnitude).reshape(len(POSITIONS), -1)
    return apply(q, HEADS), apply(k, KV_HEADS)


def qk(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(len(POSITIONS), HEADS * HEAD_DIM, generator=g),
            torch.randn(len(POSITIONS), HEAD_DIM, generator=g))


def vllm_rope(folder):
    """The rotary embedding vLLM's LlamaForCausalLMEagle3 builds: its config loader, then get_rope as LlamaAttention
    calls it (head_dim, max_position_embeddings, rope_parameters, neox style)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    config = get_config(str(folder), trust_remote_code=False)
    assert config.architectures == ["LlamaForCausalLMEagle3"]
    with set_current_vllm_config(VllmConfig()):
        return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                        rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)


@pytest.mark.vllm
@pytest.mark.parametrize("case", CASES)
def test_draft_rope_equals_vllms_for_the_exported_config(case, tmp_path):
    rope, folder = exported(tmp_path, CASES[case])
    vllm = vllm_rope(folder)
    q, k = qk()
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        vq, vk = vllm(POSITIONS, q.clone(), k.clone())
    oq, ok = ours(rope, q, k)
    torch.testing.assert_close(oq, vq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, vk, rtol=1e-5, atol=1e-5)
    # The magnitude alone moves the result: DeepSeek's other temperature convention (1 + 0.1 ln factor whatever
    # mscale says) is caught wherever it differs from the one vLLM applies.
    scaling = CASES[case].get("rope_scaling", {})
    if scaling.get("mscale"):
        trap = Rope(rope.inv_freq, get_mscale(scaling["factor"]), rope.position_divisor)
        assert not torch.allclose(ours(trap, q, k)[0], vq, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_draft_rope_equals_transformers_llama_for_the_exported_config(case, tmp_path):
    """transformers' LlamaRotaryEmbedding (what a Hugging Face load of the draft config would use) agrees too."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope, folder = exported(tmp_path, CASES[case])
    config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    q, k = qk(1)
    hq = q.view(1, len(POSITIONS), HEADS, HEAD_DIM).transpose(1, 2)
    hk = k.view(1, len(POSITIONS), KV_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(config)(hq, POSITIONS[None])
    tq, tk = apply_rotary_pos_emb(hq, hk, cos, sin)
    oq, ok = ours(rope, q, k)
    # transformers divides frequencies rather than positions for linear scaling: fp32 angles round differently.
    tol = 1e-2 if case == "linear" else 1e-5  # measured 9.9e-4 at position 20000
    torch.testing.assert_close(oq, tq.transpose(1, 2).reshape(len(POSITIONS), -1), rtol=tol, atol=tol)
    torch.testing.assert_close(ok, tk.transpose(1, 2).reshape(len(POSITIONS), -1), rtol=tol, atol=tol)


def test_kimi_yarn_keeps_unit_magnitude_and_stretches_only_slow_pairs(tmp_path):
    rope, folder = exported(tmp_path, CASES["kimi-k2"])
    assert rope.magnitude == 1.0
    plain = 1.0 / 50000.0 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    # Pairs turning more than once over 4096 positions keep their frequency; the rest are divided by 32.
    fast = 4096 * plain / (2 * math.pi) > 1
    assert fast.any() and (~fast).any()
    torch.testing.assert_close(rope.inv_freq[fast], plain[fast])
    torch.testing.assert_close(rope.inv_freq[~fast], plain[~fast] / 32)
    # The exported config carries the target's keys verbatim, where engines read them.
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == CASES["kimi-k2"]["rope_scaling"] and config["rope_theta"] == 50000.0


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope type 'longrope'"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attn_factor": 0.5}, "attn_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, "needs "
     r"\['high_freq_factor', 'low_freq_factor'\]"),
])
def test_unsupported_rope_fails_naming_the_type_and_keys(scaling, words):
    target = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "head_dim": 64,
              "vocab_size": 64, "rope_theta": 10000.0, "rope_scaling": scaling}
    with pytest.raises((NotImplementedError, ValueError), match=words):
        DraftConfig.from_target(target, draft_vocab_size=32, aux_layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def yarn_run(smollm2, tmp_path_factory):
    """The workflow up to evaluation and export for a Kimi-style target: the tiny DeepSeek-V3 with Kimi-K2's yarn
    rope keys in the published form."""
    root = tmp_path_factory.mktemp("yarn")
    target = tiny_targets.kimi_rope(root / "kimi-rope", smollm2)
    snakemake(root / "run", tiny_config(target, generation={"max_new_tokens": 8, "num_shards": 1, "chunk_size": 8},
                                        prompts={"max_prompts": 12}),
              "results/eval/acceptance.json", "results/export/checks.json")
    return root / "run"


def test_yarn_target_trains_evaluates_and_exports(yarn_run):
    """Trained, evaluated, exported with the target's rope keys verbatim, and loaded back with the same rope."""
    acceptance = json.loads((yarn_run / "results/eval/acceptance.json").read_text())
    assert acceptance["positions"] > 0 and set(acceptance["tau"]) == {"1", "2", "3"}
    checks = json.loads((yarn_run / "results/export/checks.json").read_text())
    assert checks["vllm"]["problems"] == [] and checks["sglang"]["problems"] == []
    for folder in ("results/draft", "results/export/sglang"):
        config = json.loads((yarn_run / folder / "config.json").read_text())
        assert config["rope_scaling"] == tiny_targets.KIMI_ROPE["rope_scaling"] and config["rope_theta"] == 50000.0
    loaded = load_checkpoint(yarn_run / "results/draft").midlayer.self_attn.rope
    expected = build(tiny_targets.KIMI_ROPE, loaded.inv_freq.numel() * 2)
    assert torch.equal(loaded.inv_freq, expected.inv_freq) and loaded.magnitude == expected.magnitude == 1.0
    plain = build({"rope_theta": 50000.0}, loaded.inv_freq.numel() * 2)
    assert not torch.allclose(loaded.inv_freq, plain.inv_freq)  # the draft ropes with yarn, not plain rope


@pytest.mark.vllm
def test_vllm_ropes_the_exported_yarn_draft_as_it_was_trained(yarn_run):
    """The workflow's own export, loaded by vLLM's config loader, gives vLLM the rope the trained draft applies."""
    from vllm.config import VllmConfig, set_current_vllm_config

    vllm = vllm_rope(yarn_run / "results/draft")
    trained = load_checkpoint(yarn_run / "results/draft").midlayer.self_attn.rope
    q, k = qk(2)
    with set_current_vllm_config(VllmConfig()):
        vq, vk = vllm(POSITIONS, q.clone(), k.clone())
    oq, ok = ours(trained, q, k)
    torch.testing.assert_close(oq, vq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, vk, rtol=1e-5, atol=1e-5)


def test_export_check_catches_a_draft_config_without_the_mscale_keys(tmp_path):
    """Dropping mscale/mscale_all_dim from the exported config would make vLLM serve at 1 + 0.1 ln 32: caught."""
    rope, folder = exported(tmp_path / "draft", CASES["kimi-k2"])
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 128, "vocab_size": 64,
                                                    **CASES["kimi-k2"]}))

    def check():
        return export.check(folder, "vllm", layer_ids=[1, 2, 3], target_dir=target, serving_context=4096)

    assert check() == []
    config = json.loads((folder / "config.json").read_text())
    del config["rope_scaling"]["mscale"], config["rope_scaling"]["mscale_all_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    assert len(check()) == 1 and "rope settings" in check()[0] and "mscale" in check()[0]
