"""Prompt stage: read prompt files in any of three forms, normalise, de-duplicate, split train/eval.

Accepted files: JSONL (one record a line), a JSON array of records (.json, as ShareGPT is distributed) or Parquet
(as UltraChat is: columns prompt, prompt_id, messages). Records, one conversation each:
    {"messages": [{"role": "user", "content": "..."}, ...]}          OpenAI / UltraChat form
    {"conversations": [{"from": "human", "value": "..."}, ...]}      ShareGPT form
    {"prompt": "..."}                                                 plain form
An optional "id" (or "prompt_id") is kept; otherwise the id is the content hash. Trailing assistant turns are
dropped: the target regenerates them (earlier ones stay; generation.multi_turn decides whether they are regenerated
too). System turns follow prompts.system_policy. Prompts the target wrote itself (eaglepipe/synthesize.py) join the
files' prompts at prompts.synthesize.share. Split: a record is eval when hash(id) falls below eval_fraction, so
adding prompts never moves existing ones between splits.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import resources
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .formats import PROMPT_SCHEMA, read_table, stable_hash, write_table

log = logging.getLogger(__name__)

ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}


class PromptError(ValueError):
    pass


def default_source() -> str:
    return str(resources.files("eaglepipe") / "data" / "prompts.jsonl")


def read_records(path) -> list[tuple[int, dict]]:
    """(row number starting at 1, record) for each record of a JSONL, JSON-array or Parquet file (a JSON array's
    row is its record's position in the array, from 1)."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist; fix config key prompts.sources")
    if path.suffix == ".parquet":
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), start=1))
        except (pa.ArrowInvalid, OSError) as err:
            raise PromptError(f"prompt file {path}: not a readable Parquet file ({err}); fix or replace it") from None
    if _is_json_array(path):
        return _read_json_array(path)
    records = []
    with open(path, "rb") as f:
        for row, raw in enumerate(f, start=1):
            line = _decode(path, raw, row)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptError(f"{path}, row {row}: not valid JSON ({err.msg} at column {err.colno}); "
                                  "fix or remove that line") from None
            if not isinstance(record, dict):
                raise PromptError(f"{path}, row {row}: expected a JSON object, got {type(record).__name__}")
            records.append((row, record))
    return records


def _decode(path, data: bytes, first_row: int = 1, unit: str = "row") -> str:
    """data (the file's text from row first_row on) as UTF-8; PromptError naming the row and column of the first
    byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        row = first_row + data.count(b"\n", 0, err.start)
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise PromptError(f"{path}, {unit} {row}: byte 0x{data[err.start]:02x} at column {column} is not UTF-8; save "
                          "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE) or fix that line") from None


def _is_json_array(path: Path) -> bool:
    """Whether the file holds one JSON array (its first non-blank character is '[')."""
    with open(path, "rb") as f:
        while True:
            block = f.read(4096)
            if not block:
                return False
            stripped = block.lstrip()
            if stripped:
                return stripped[:1] == b"["


def _read_json_array(path: Path) -> list[tuple[int, dict]]:
    try:
        data = json.loads(_decode(path, path.read_bytes(), unit="line"))
    except json.JSONDecodeError as err:
        raise PromptError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                          "fix the file (a JSON array of records, or one record a line)") from None
    for row, record in enumerate(data, start=1):
        if not isinstance(record, dict):
            raise PromptError(f"{path}, record {row} of the array: expected a JSON object, got "
                              f"{type(record).__name__}")
    return list(enumerate(data, start=1))


def count_records(path) -> int:
    """Records in a prompt file, without normalising them (for the plan)."""
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.ParquetFile(path).metadata.num_rows
    if _is_json_array(path):
        return len(_read_json_array(path))
    with open(path, "rb") as f:
        return sum(1 for row, line in enumerate(f, start=1) if _decode(path, line, row).strip())


def normalise(record: dict, where: str) -> list[dict]:
    """The record's conversation as [{"role", "content"}], ending with a user turn."""
    if "messages" in record:
        turns = [(m.get("role"), m.get("content")) for m in _as_list(record["messages"], "messages", where)]
    elif "conversations" in record:
        turns = [(m.get("from"), m.get("value")) for m in _as_list(record["conversations"], "conversations", where)]
    elif "prompt" in record:
        turns = [("user", record["prompt"])]
    else:
        raise PromptError(f"{where}: no 'messages', 'conversations' or 'prompt' field (found {sorted(record)}); "
                          "each record needs one of them")
    messages = []
    for n, (role, content) in enumerate(turns):
        if role not in ROLES:
            raise PromptError(f"{where}: turn {n} has unknown role {role!r}; use one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise PromptError(f"{where}: turn {n} content must be a string, got {type(content).__name__}")
        messages.append({"role": ROLES[role], "content": content.strip()})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user":
        raise PromptError(f"{where}: the conversation has no user turn to answer")
    if not messages[-1]["content"]:
        raise PromptError(f"{where}: the last user turn is empty; remove the record or give it text")
    return messages


def _as_list(value, name, where) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise PromptError(f"{where}: '{name}' must be a list of objects")
    return value


def content_hash(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


def split_of(prompt_id: str, eval_fraction: float) -> str:
    return "eval" if stable_hash(prompt_id) % 1_000_000 < eval_fraction * 1_000_000 else "train"


def _entries(sources: list[str], synthesized):
    """(where, record, source name, synthesized?) for every record of the prompt files, then the synthesized ones."""
    for source in sources:
        for row, record in read_records(source):
            yield f"{source}, row {row}", record, Path(source).name, False
    if synthesized:
        from .synthesize import SOURCE_NAME, SYNTH_SCHEMA

        for row, record in enumerate(read_table(synthesized, SYNTH_SCHEMA), start=1):
            yield f"{synthesized}, row {row}", {"id": record["id"], "prompt": record["prompt"]}, SOURCE_NAME, True


def mix(files: list[dict], synthesized: list[dict], share: float | None) -> tuple[list[dict], list[dict]]:
    """The prompts of files and synthesized ones at `share` synthesized (of both together): the kind in excess is
    cut to fit, keeping those first by hash of id. None keeps all of both."""
    if share is None or not synthesized:
        return files, synthesized
    if not 0 < share <= 1:
        raise PromptError(f"config key prompts.synthesize.share: {share!r} is out of range; use a number in (0, 1] "
                          "or null")

    def first(rows, n):
        return sorted(rows, key=lambda r: stable_hash(r["id"]))[:n]

    if share == 1:
        return [], synthesized
    if len(synthesized) > share * (len(files) + len(synthesized)):
        return files, first(synthesized, max(1, round(share * len(files) / (1 - share))))
    return first(files, round(len(synthesized) * (1 - share) / share)), synthesized


def run(sources: list[str], outputs: dict, *, eval_fraction: float, max_prompts: int | None,
        max_prompt_tokens: int, too_long: str, target_dir, system_prompt: str | None, template_kwargs: dict,
        system_policy: str = "add", chat_template: str | None = None, synthesized=None,
        share: float | None = None) -> None:
    """Write the train and eval prompt tables. `synthesized`: the synthesis table (eaglepipe/synthesize.py) whose
    prompts join the files' at `share` (prompts.synthesize.share); a synthesized prompt longer than
    max_prompt_tokens is always skipped (there is no row of a user's file to fix)."""
    from .chat import load_tokenizer, render_chat
    from .reasoning import apply_system_policy, read_template

    tokenizer = load_tokenizer(target_dir, read_template(chat_template) if chat_template else None)
    sources = [] if synthesized and share == 1 else (sources or [default_source()])
    seen: dict[str, str] = {}
    kept = {False: [], True: []}  # by synthesized?
    skipped = duplicates = 0
    for where, record, source_name, is_synthesized in _entries(sources, synthesized):
        messages = normalise(record, where)
        messages = apply_system_policy(messages, system_policy, system_prompt)
        digest = content_hash(messages)
        if digest in seen:
            duplicates += 1
            continue
        prompt_id = str(record.get("id") or record.get("prompt_id") or digest)
        if prompt_id in seen.values():
            raise PromptError(f"{where}: id {prompt_id!r} is used by another record with different content")
        n_tokens = len(render_chat(tokenizer, messages, template_kwargs))
        if n_tokens > max_prompt_tokens:
            if too_long == "skip" or is_synthesized:
                skipped += 1
                continue
            raise PromptError(f"{where}: prompt is {n_tokens} tokens, longer than prompts.max_prompt_tokens "
                              f"({max_prompt_tokens}); shorten it, raise the limit, or set "
                              "prompts.too_long: skip")
        seen[digest] = prompt_id
        kept[is_synthesized].append(
            {"id": prompt_id, "messages": json.dumps(messages, ensure_ascii=False), "source": source_name})
    files, synth = mix(kept[False], kept[True], share)
    if synthesized:
        log.info("prompts: %d from files and %d synthesized kept of %d and %d (prompts.synthesize.share %s)",
                 len(files), len(synth), len(kept[False]), len(kept[True]), share)
    rows = {"train": [], "eval": []}
    for row in files + synth:
        rows[split_of(row["id"], eval_fraction)].append(row)
    for split in rows:
        rows[split].sort(key=lambda r: r["id"])
        if max_prompts:
            rows[split] = rows[split][: max(1, round(max_prompts * (eval_fraction if split == "eval"
                                                                     else 1 - eval_fraction)))]
        if not rows[split]:
            raise PromptError(f"no prompts landed in the {split} split ({sum(map(len, rows.values()))} in all); "
                              "add prompts or change prompts.eval_fraction")
    for split, path in outputs.items():
        write_table(path, rows[split], PROMPT_SCHEMA)
    log.info("prompts: %d train, %d eval, %d duplicates dropped, %d too long skipped",
             len(rows["train"]), len(rows["eval"]), duplicates, skipped)
