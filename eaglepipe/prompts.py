"""Prompt stage: read prompt files in any of three forms, normalise, de-duplicate, split train/eval.

Accepted records (JSONL or Parquet), one conversation each:
    {"messages": [{"role": "user", "content": "..."}, ...]}          OpenAI form
    {"conversations": [{"from": "human", "value": "..."}, ...]}      ShareGPT form
    {"prompt": "..."}                                                 plain form
An optional "id" is kept; otherwise the id is the content hash. Trailing assistant turns are dropped: the target
regenerates them (earlier ones stay; generation.multi_turn decides whether they are regenerated too). System turns
follow prompts.system_policy. Split: a record is eval when hash(id) falls below eval_fraction, so adding prompts never moves
existing ones between splits.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import resources
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .formats import PROMPT_SCHEMA, stable_hash, write_table

log = logging.getLogger(__name__)

ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


class PromptError(ValueError):
    pass


def default_source() -> str:
    return str(resources.files("eaglepipe") / "data" / "prompts.jsonl")


def read_records(path) -> list[tuple[int, dict]]:
    """(row number starting at 1, record) for each record of a JSONL or Parquet file."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist; fix config key prompts.sources")
    if path.suffix == ".parquet":
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), start=1))
        except (pa.ArrowInvalid, OSError) as err:
            raise PromptError(f"prompt file {path}: not a readable Parquet file ({err}); fix or replace it") from None
    records = []
    with open(path, encoding="utf-8") as f:
        for row, line in enumerate(f, start=1):
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


def run(sources: list[str], outputs: dict, *, eval_fraction: float, max_prompts: int | None,
        max_prompt_tokens: int, too_long: str, target_dir, system_prompt: str | None, template_kwargs: dict,
        system_policy: str = "add", chat_template: str | None = None) -> None:
    from .chat import load_tokenizer, render_chat
    from .reasoning import apply_system_policy, read_template

    tokenizer = load_tokenizer(target_dir, read_template(chat_template) if chat_template else None)
    sources = sources or [default_source()]
    seen: dict[str, str] = {}
    rows = {"train": [], "eval": []}
    skipped = duplicates = 0
    for source in sources:
        for row, record in read_records(source):
            where = f"{source}, row {row}"
            messages = normalise(record, where)
            messages = apply_system_policy(messages, system_policy, system_prompt)
            digest = content_hash(messages)
            if digest in seen:
                duplicates += 1
                continue
            prompt_id = str(record.get("id") or digest)
            if prompt_id in seen.values():
                raise PromptError(f"{where}: id {prompt_id!r} is used by another record with different content")
            n_tokens = len(render_chat(tokenizer, messages, template_kwargs))
            if n_tokens > max_prompt_tokens:
                if too_long == "skip":
                    skipped += 1
                    continue
                raise PromptError(f"{where}: prompt is {n_tokens} tokens, longer than prompts.max_prompt_tokens "
                                  f"({max_prompt_tokens}); shorten it, raise the limit, or set "
                                  "prompts.too_long: skip")
            seen[digest] = prompt_id
            rows[split_of(prompt_id, eval_fraction)].append(
                {"id": prompt_id, "messages": json.dumps(messages, ensure_ascii=False), "source": Path(source).name})
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
