"""Synthesized prompts (eaglepipe/synthesize.py): the target writes its own user prompts, seeded and filtered."""

import json
import random
import shutil
import time

import pytest

import eaglepipe.config
from eaglepipe import prompts, synthesize
from eaglepipe.chat import load_tokenizer
from eaglepipe.formats import read_table, write_table

from conftest import TOKENIZER_FILES, planned_rules, tiny_config


def settings(**overrides) -> dict:
    """prompts.synthesize with the schema's defaults filled in, as the rule passes it."""
    config = {"prompts": {"synthesize": overrides}}
    eaglepipe.config.validate(config)
    return config["prompts"]["synthesize"]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return load_tokenizer(smollm2)


def sample(tokenizer, text, n=0, finish="stop", error="", end=True):
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if end else [])
    return {"sample": n, "output_ids": ids, "finish_reason": finish, "error": error}


def run_filters(tokenizer, samples, **kw):
    args = dict(max_prompt_tokens=192, min_letter_share=0.5, near_duplicate_threshold=0.7)
    args.update(kw)
    rows, counts = synthesize.filter_samples(samples, tokenizer, **args)
    return [r["prompt"] for r in rows], counts


# --- the same seed gives the same prompt set, byte for byte, on the real target -------------------------------


def synthesize_once(out, target, **overrides):
    synthesize.run(out / "synthesized.parquet", out / "synthesized.json", target_dir=target,
                   engine={"name": "transformers", "device": "cpu", "dtype": "float32", "threads": 1,
                           "batch_size": 8},
                   settings=settings(**{"enabled": True, "count": 6, "chunk_size": 3, "max_new_tokens": 24,
                                        **overrides}),
                   template_kwargs={}, progress_dir=out / "progress")
    return (out / "synthesized.parquet").read_bytes(), json.loads((out / "synthesized.json").read_text())


def test_same_seed_gives_the_same_prompts_byte_for_byte(tmp_path, smollm2):
    first, counts = synthesize_once(tmp_path / "a", smollm2)
    second, counts_again = synthesize_once(tmp_path / "b", smollm2)
    assert first == second and counts == counts_again
    assert counts["kept"] + sum(counts["rejected"].values()) == 6
    rows = read_table(tmp_path / "a" / "synthesized.parquet", synthesize.SYNTH_SCHEMA)
    assert len(rows) == counts["kept"] >= 1
    assert len({r["prompt"] for r in rows}) == len(rows)  # the two chunks are seeded apart, not repeated
    for r in rows:
        assert r["prompt"].strip() and "<|im_start|>" not in r["prompt"] and r["id"].startswith("syn-")
    assert not (tmp_path / "a" / "progress").exists()  # resume units are removed once the output is written


# --- the prefix ------------------------------------------------------------------------------------------------


def test_prefix_is_the_template_up_to_the_users_text(tokenizer):
    assert tokenizer.decode(synthesize.user_prefix(tokenizer)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n")
    assert tokenizer.decode(synthesize.user_prefix(tokenizer, "Be brief.")) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


# --- each filter rejects what it names and keeps what it does not ----------------------------------------------


def test_error_and_truncated_filters(tokenizer):
    kept, counts = run_filters(tokenizer, [
        sample(tokenizer, "What is a good name for a cat?", error="engine failed"),
        sample(tokenizer, "Tell me a story about a dragon who", finish="length", end=False),
        sample(tokenizer, "How do I bake bread at home?"),
    ])
    assert kept == ["How do I bake bread at home?"]
    assert counts["error"] == 1 and counts["truncated"] == 1


def test_empty_filter(tokenizer):
    kept, counts = run_filters(tokenizer, [sample(tokenizer, "   \n "), sample(tokenizer, "", end=True),
                                           sample(tokenizer, "Hi")])
    assert kept == ["Hi"] and counts["empty"] == 2


@pytest.mark.parametrize("text", [
    "Write a haiku <|im_start|>assistant\nabout rain",  # the template's special token leaks
    "Describe the ocean<|endoftext|>",
    "List three fruits\x07 please",  # control character
    "1234 5678 = 9 + 10 ### !!! ???",  # few letters
    "Ex\ufffdplain gravity",  # undecodable bytes
], ids=["im_start", "endoftext", "control", "few-letters", "replacement-char"])
def test_non_text_filter_rejects(tokenizer, text):
    kept, counts = run_filters(tokenizer, [sample(tokenizer, text)])
    assert kept == [] and counts["non_text"] == 1


@pytest.mark.parametrize("text", [
    "Write a Python function that returns x + 1 for a list of numbers.",
    "Объясни, что такое фотосинтез, простыми словами.",
    "日本の首都はどこですか？",
    "Line one\n\tindented line two",
], ids=["code-request", "russian", "japanese", "newline-tab"])
def test_non_text_filter_keeps(tokenizer, text):
    kept, counts = run_filters(tokenizer, [sample(tokenizer, text)])
    assert kept == [text] and counts["non_text"] == 0


def test_over_long_filter(tokenizer):
    long = " ".join(["word"] * 40)
    n = len(tokenizer.encode(long, add_special_tokens=False))
    kept, counts = run_filters(tokenizer, [sample(tokenizer, long)], max_prompt_tokens=n - 1)
    assert kept == [] and counts["over_long"] == 1
    kept, counts = run_filters(tokenizer, [sample(tokenizer, long)], max_prompt_tokens=n)  # at the limit: kept
    assert kept == [long] and counts["over_long"] == 0


def test_exact_duplicate_filter(tokenizer):
    kept, counts = run_filters(tokenizer, [sample(tokenizer, "How do  I plan a trip?", 0),
                                           sample(tokenizer, "how do I plan a\ntrip?", 1),
                                           sample(tokenizer, "How do I plan a trip to Rome?", 2)])
    assert kept == ["How do  I plan a trip?", "How do I plan a trip to Rome?"]
    assert counts["exact_duplicate"] == 1


def test_near_duplicate_filter(tokenizer):
    base = "Can you help me write a short cover letter for a junior accountant position at a small firm"
    near = base + " please"  # 16 of its 17 word 3-grams shared: Jaccard 0.94
    other = "Can you help me find a good recipe for a vegetarian lasagna with spinach and ricotta"
    kept, counts = run_filters(tokenizer, [sample(tokenizer, base, 0), sample(tokenizer, near, 1),
                                           sample(tokenizer, other, 2)])
    assert kept == [base, other] and counts["near_duplicate"] == 1


def test_near_duplicate_threshold_is_exact():
    a = " ".join(f"w{i}" for i in range(30))  # 28 word 3-grams
    b = " ".join(f"w{i}" for i in range(1, 31))  # shares 27 of them: Jaccard 27 / 29 = 0.931
    assert synthesize.NearDuplicates(0.94).keep([a, b]) == [True, True]
    assert synthesize.NearDuplicates(0.93).keep([a, b]) == [True, False]


def test_near_duplicates_scale_and_find_planted_copies():
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(5000)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 40))) for _ in range(20000)]
    planted = [t + " thanks" for t in texts[:300]]
    start = time.monotonic()
    keep = synthesize.NearDuplicates(0.7).keep(texts + planted)
    elapsed = time.monotonic() - start
    assert keep[:20000] == [True] * 20000 and not any(keep[20000:])
    assert elapsed < 20, f"near-duplicate filter took {elapsed:.1f}s for 20,300 prompts"


# --- mixing with prompt files ----------------------------------------------------------------------------------


def mixed(tmp_path, target, share, n_files=20, n_synth=20, extra_synth=()):
    tmp_path.mkdir()
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"id": f"file-{i}", "prompt": f"file question {i}"}) + "\n"
                              for i in range(n_files)))
    texts = [f"synthesized question {i}" for i in range(n_synth)] + list(extra_synth)
    synth = tmp_path / "synthesized.parquet"
    write_table(synth, [{"id": synthesize.prompt_id(t), "prompt": t, "sample": i, "tokens": 3}
                        for i, t in enumerate(texts)], synthesize.SYNTH_SCHEMA)
    out = {"train": tmp_path / "out" / "train.parquet", "eval": tmp_path / "out" / "eval.parquet"}
    prompts.run([str(source)], out, eval_fraction=0.3, max_prompts=None, max_prompt_tokens=256, too_long="error",
                target_dir=target, system_prompt=None, template_kwargs={}, synthesized=str(synth), share=share)
    rows = [r for path in out.values() for r in read_table(path)]
    return sum(r["source"] == "synthesized" for r in rows), sum(r["source"] == "p.jsonl" for r in rows)


def test_share_mixes_files_and_synthesized(tmp_path, smollm2):
    assert mixed(tmp_path / "null", smollm2, None) == (20, 20)
    assert mixed(tmp_path / "quarter", smollm2, 0.25) == (7, 20)  # round(0.25 * 20 / 0.75): synthesized cut
    assert mixed(tmp_path / "most", smollm2, 0.8) == (20, 5)  # files cut to 20 * 0.2 / 0.8
    assert mixed(tmp_path / "all", smollm2, 1.0) == (20, 0)  # the files are not read
    # a synthesized prompt equal to a file's is a duplicate, dropped
    assert mixed(tmp_path / "dup", smollm2, None, extra_synth=["file question 3"]) == (20, 20)


# --- bad settings get clear errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("share", [1.5, 0, -0.2])
def test_share_out_of_range(share):
    with pytest.raises(eaglepipe.config.ConfigError, match="prompts.synthesize.share"):
        settings(share=share)
    with pytest.raises(synthesize.SynthesizeError, match=r"prompts.synthesize.share: .* out of range.*\(0, 1\]"):
        synthesize.check_settings({**settings(), "share": share})
    with pytest.raises(prompts.PromptError, match="prompts.synthesize.share"):
        prompts.mix([{"id": "a"}], [{"id": "b"}], share)


def test_greedy_synthesis_is_refused():
    with pytest.raises(synthesize.SynthesizeError, match="prompts.synthesize.temperature"):
        synthesize.check_settings({**settings(), "temperature": 0})


def test_target_without_chat_template_names_the_key(tmp_path, smollm2):
    bare = tmp_path / "no-template"
    bare.mkdir()
    for name in TOKENIZER_FILES:
        if name != "chat_template.jinja":
            shutil.copy(smollm2 / name, bare / name)
    with pytest.raises(synthesize.SynthesizeError, match="target.chat_template"):
        synthesize.run(tmp_path / "s.parquet", tmp_path / "s.json", target_dir=bare, engine={"name": "transformers"},
                       settings=settings(enabled=True), template_kwargs={})
    assert not (tmp_path / "s.parquet").exists()


def test_template_that_rewrites_the_users_text_is_refused(smollm2):
    tokenizer = load_tokenizer(smollm2, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                        "{{ m['content'] | upper }}<|im_end|>\n{% endfor %}")
    with pytest.raises(synthesize.SynthesizeError, match="does not write the user's text as given"):
        synthesize.user_prefix(tokenizer)


# --- the workflow: the rule runs only when synthesis is on -----------------------------------------------------


def test_workflow_plans_synthesis_only_when_enabled(tmp_path, tiny_target):
    assert "synthesize_prompts" not in planned_rules(tmp_path / "off", tiny_config(tiny_target))
    on = tiny_config(tiny_target, prompts={"max_prompts": 24, "synthesize": {"enabled": True, "count": 16}})
    assert {"synthesize_prompts", "prompts"} <= planned_rules(tmp_path / "on", on)


def test_plan_counts_synthesized_prompts_as_an_upper_bound():
    from eaglepipe.estimate import count_prompts, gpu_rules

    def plan_count(**synth):
        config = {"prompts": {"synthesize": synth}, "engine": {"gpus": 1}}
        eaglepipe.config.validate(config)
        return count_prompts(config), [r["rule"] for r in gpu_rules(config)]

    files = len(prompts.read_records(prompts.default_source()))
    engine_rules = ["traces", "hidden_states", "benchmark_traces", "benchmark_hidden_states"]
    assert plan_count() == (files, engine_rules + ["bench"])
    assert plan_count(enabled=True, count=24000)[0] == files + 24000
    assert plan_count(enabled=True, count=24000, share=1.0) == (24000, ["synthesize_prompts"] + engine_rules
                                                                + ["bench"])
    assert plan_count(enabled=True, count=24000, share=0.5)[0] == 2 * files  # the files' side limits


def test_plan_counts_the_gpu_jobs_of_variants_and_benchmark_sets():
    """With train.variants the plan lists each variant's training and scoring (one per variant and benchmark set)
    in place of the one training job, as the workflow runs them."""
    from eaglepipe.estimate import gpu_rules

    config = {"engine": {"gpus": 8}, "train": {"gpus": 8, "variants": {"a": {}, "b": {"lr": 3e-4}, "c": {}}},
              "evaluate": {"device": "cuda", "benchmarks": ["mtbench", "extra.jsonl"]}}
    eaglepipe.config.validate(config)
    jobs = {r["rule"]: (r["jobs"], r["gpus_per_job"]) for r in gpu_rules(config)}
    assert jobs == {"traces": (8, 8), "hidden_states": (8, 8), "benchmark_traces": (2, 8),
                    "benchmark_hidden_states": (2, 8), "train_variant": (3, 8), "evaluate_variant": (3, 1),
                    "benchmark_evaluate_variant": (6, 1), "evaluate": (1, 1), "benchmark_evaluate": (2, 1),
                    "bench": (1, 8)}
