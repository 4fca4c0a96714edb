"""The diagnosis's own logic: template variants, the noise of a served tau, and how a cause is named."""

import pytest

from eaglepipe.diagnose import name_cause, std_error, template_variants
from eaglepipe.chat import load_tokenizer, render_chat


def test_std_error_of_accepted_length_from_per_position_counts():
    # 100 drafts: 50 accepted >= 1 token, 20 accepted 2: lengths 0 (50), 1 (30), 2 (20): mean 0.7, variance 0.61.
    assert std_error([50, 20], 100) == pytest.approx((0.61 / 100) ** 0.5)
    assert std_error([0, 0], 100) == 0.0


def variant(name, tau, se=0.05, **extra):
    return {"variant": name, "served_tau": tau, "std_error": se, **extra}


def test_the_variant_that_recovers_names_the_cause_and_its_direction():
    results = [variant("as served", 1.10, kind="none", layer_ids=[3, 5, 6]),
               variant("aux layer ids -1", 1.55, kind="layer_ids", shift=-1, layer_ids=[2, 4, 5]),
               variant("aux layer ids +1", 1.02, kind="layer_ids", shift=1, layer_ids=[4, 6, 7])]
    assert name_cause(results, offline=1.9, tolerance=0.05) == (
        "aux layer ids off by +1: draft config has [3, 5, 6], served tau recovers to 1.550 (from 1.100; offline "
        "1.900) with [2, 4, 5]")
    results.append(variant("empty system prompt", 1.80, kind="template"))
    assert name_cause(results, offline=1.9, tolerance=0.05).startswith(
        "chat template at serving differs from the traces': served tau recovers to 1.800")


def test_a_gain_within_the_noise_names_nothing():
    results = [variant("as served", 1.35, se=0.07, kind="none", layer_ids=[2, 4, 5]),
               variant("aux layer ids -1", 1.48, se=0.07, kind="layer_ids", shift=-1, layer_ids=[1, 3, 4])]
    assert name_cause(results, offline=1.8, tolerance=0.05) is None  # gain 0.13 < 2 * 0.099
    results[1]["std_error"] = results[0]["std_error"] = 0.02
    assert name_cause(results, offline=1.8, tolerance=0.05) is not None


def test_template_variants_differ_from_the_served_rendering(smollm2):
    tokenizer = load_tokenizer(smollm2)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}]]
    served = [render_chat(tokenizer, conversations[0])]
    variants = template_variants(tokenizer, conversations, {}, traced=served)
    assert "prompt ids the traces used" not in variants  # identical to the served rendering: nothing to try
    assert "system turns dropped" not in variants  # no system turn to drop
    # SmolLM2's template adds a default system prompt; an empty system turn removes it.
    assert len(variants["empty system prompt"][0]) < len(served[0])
    assert variants["without add_generation_prompt"][0] == served[0][:len(variants["without add_generation_prompt"][0])]
    traced = [served[0][:-1]]
    assert template_variants(tokenizer, conversations, {}, traced=traced)["prompt ids the traces used"] == traced


def test_an_override_template_is_tried_against_the_targets_own(smollm2):
    override = load_tokenizer(smollm2, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    conversations = [[{"role": "user", "content": "Name a prime number."}]]
    variants = template_variants(override, conversations, {}, traced=None, target_tokenizer=load_tokenizer(smollm2))
    assert variants["the target's own chat template"] == [render_chat(load_tokenizer(smollm2), conversations[0])]
    assert "the target's own chat template" not in template_variants(override, conversations, {}, traced=None)


def test_multi_turn_all_skips_the_traces_prompt_ids_and_keeps_every_other_variant(smollm2):
    from eaglepipe.diagnose import skipped_variants
    from eaglepipe.report import served_section

    tokenizer = load_tokenizer(smollm2)
    given = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello, how can I help?"},
             {"role": "user", "content": "Name a colour."}]
    # What multi_turn `all` stores: the same conversation with the target's own earlier answer in place of the given.
    regenerated = [given[0], {"role": "assistant", "content": "Hi there."}, given[2]]
    traced = [render_chat(tokenizer, regenerated)]
    last = template_variants(tokenizer, [given], {}, traced=traced)
    assert last["prompt ids the traces used"] == traced  # `last`: stored ids differ from served, so they are tried
    every = template_variants(tokenizer, [given], {}, traced=traced, multi_turn="all")
    assert "prompt ids the traces used" not in every
    assert every == {name: ids for name, ids in last.items() if name != "prompt ids the traces used"}
    assert {"empty system prompt", "without add_generation_prompt"} <= set(every)
    assert skipped_variants("last") == {}
    (line,) = [f"{name}: {why}" for name, why in skipped_variants("all").items()]
    assert line.startswith("prompt ids the traces used: not tried: generation.multi_turn is 'all'")
    bench = {"prompts": 1, "max_new_tokens": 8, "offline_text": "the same text", "k": {}, "speedup": {},
             "diagnosis": {"k": 2, "prompts": 1, "finding": "none", "variants": [], "skipped": [line]}}
    assert f"Variant {line}." in "\n".join(served_section(bench))
