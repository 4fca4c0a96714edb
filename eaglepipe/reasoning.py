"""Thinking targets, chat templates and conversations: what the target is asked and how its answer is read.

Everything here works on token ids the engine produced; text is derived for people and never re-tokenised into
training data. The stored token stream of a row is prompt_ids + output_ids; loss_spans name the [start, end)
positions of that stream the engine generated (the mask the hidden-state stage applies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SYSTEM_POLICIES = ("keep", "drop", "replace", "add")
STATUSES = ("complete", "unterminated", "absent")  # "" when the target has no reasoning markers


@dataclass(frozen=True)
class Markers:
    start: str
    end: str


@dataclass(frozen=True)
class Split:
    reasoning: str
    response: str
    status: str  # one of STATUSES, or "" without markers


def read_template(path) -> str:
    """The text of an override chat template file, checked to be a Jinja template that renders a conversation."""
    import jinja2

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config key target.chat_template: {str(path)!r} is not a file; point it at a Jinja chat "
                         "template (e.g. chat_template.jinja) or set it to null for the target's own template")
    text = path.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"config key target.chat_template: {path}, line {err.lineno}: not a valid Jinja template "
                         f"({err.message})") from None
    if "messages" not in text:
        raise ValueError(f"config key target.chat_template: {path} never reads `messages`; a chat template renders "
                         "the conversation from that variable")
    return text


def resolve_markers(setting, tokenizer) -> Markers | None:
    """Reasoning markers from config: a {start, end} map, false (none), or null (detect <think>...</think> when
    the chat template writes them and the tokenizer knows them)."""
    if setting is False:
        return None
    if isinstance(setting, dict):
        markers = Markers(setting["start"], setting["end"])
        for name, text in (("start", markers.start), ("end", markers.end)):
            if not tokenizer.encode(text, add_special_tokens=False):
                raise ValueError(f"config key target.reasoning.{name}: {text!r} encodes to no tokens")
        return markers
    template = tokenizer.chat_template or ""
    vocab = tokenizer.get_vocab()
    if "<think>" in template and "</think>" in template and "<think>" in vocab and "</think>" in vocab:
        return Markers("<think>", "</think>")
    return None


def apply_system_policy(messages: list[dict], policy: str, text: str | None) -> list[dict]:
    """The conversation with its system turn kept, dropped, replaced by `text`, or `text` added if missing."""
    if policy not in SYSTEM_POLICIES:
        raise ValueError(f"config key prompts.system_policy: {policy!r}; use one of {', '.join(SYSTEM_POLICIES)}")
    if policy == "replace" and text is None:
        raise ValueError("config key prompts.system_policy is 'replace' but prompts.system_prompt is null; "
                         "give the replacement text")
    rest = [m for m in messages if m["role"] != "system"]
    if policy == "keep" or (policy == "add" and (text is None or len(rest) < len(messages))):
        return messages
    if policy == "drop":
        return rest
    return [{"role": "system", "content": text}] + rest


def _find(seq: list[int], sub: list[int], start: int = 0) -> int:
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i: i + len(sub)] == sub:
            return i
    return -1


def split(tokenizer, markers: Markers | None, prompt_ids: list[int], output_ids: list[int]) -> Split:
    """Reasoning and response text of one generation, read from its token ids. The reasoning is open when the
    output starts with the start marker or the prompt's last tokens hold it (templates that pre-fill it); it ends
    at the first end marker."""
    def text(ids, skip):
        return tokenizer.decode(ids, skip_special_tokens=skip).strip()

    if markers is None:
        return Split("", text(output_ids, True), "")
    start = tokenizer.encode(markers.start, add_special_tokens=False)
    end = tokenizer.encode(markers.end, add_special_tokens=False)
    tail = list(prompt_ids[-(len(start) + 3):])
    prefilled = _find(tail, start) >= 0 and _find(tail, end, _find(tail, start)) < 0
    opened = not prefilled and list(output_ids[: len(start)]) == start
    body = len(start) if opened else 0
    e = _find(output_ids, end, body)
    if not (prefilled or opened) and e < 0:
        return Split("", text(output_ids, True), "absent")
    if e < 0:
        return Split(text(output_ids[body:], True), "", "unterminated")
    return Split(text(output_ids[body:e], True), text(output_ids[e + len(end):], True), "complete")


def history_message(parts: Split) -> dict:
    """An assistant turn for the next render: response as content, reasoning beside it where templates read it."""
    message = {"role": "assistant", "content": parts.response}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    return message


def loss_spans(turns: list[tuple[list[int], list[int]]], stream: list[int]) -> list[int]:
    """Flattened [start, end) spans of `stream` the engine generated: each turn's (prompt_ids, output_ids) counts
    only where prompt + output is exactly a prefix of the stream (same tokens in the same context)."""
    spans = []
    for prompt, output in turns:
        n = len(prompt) + len(output)
        if output and stream[:n] == list(prompt) + list(output):
            spans += [len(prompt), n]
    return spans


def stats(rows: list[dict]) -> dict:
    """Capture figures of trace rows: reasoning complete, truncated inside reasoning, empty responses, errors."""
    ok = [r for r in rows if not r["error"]]
    n = max(len(ok), 1)
    status = [r["reasoning_status"] for r in ok]
    thinking = any(status)
    unterminated = [r for r in ok if r["reasoning_status"] == "unterminated"]
    return {
        "responses": len(ok),
        "errors": len(rows) - len(ok),
        "reasoning_capture_rate": status.count("complete") / n if thinking else None,
        "reasoning_unterminated": len(unterminated),
        "truncated_in_reasoning_share": sum(r["finish_reason"] == "length" for r in unterminated) / n,
        "reasoning_absent": status.count("absent"),
        # The target finished (or never started) thinking and then said nothing.
        "empty_responses": sum(r["reasoning_status"] != "unterminated" and not r["response"] for r in ok),
        "earlier_turns_regenerated": sum(r["turns"] - 1 for r in ok),
        "earlier_turns_masked": sum(end <= r["prompt_tokens"] for r in ok for end in r["loss_spans"][1::2]),
    }


def _rounds(messages: list[dict], multi_turn: str) -> list[list[dict]]:
    """The given turns each regenerated assistant turn follows (for `last`, the whole conversation once)."""
    if multi_turn == "last":
        return [messages]
    rounds, current = [], []
    for m in messages:
        if m["role"] == "assistant":
            rounds.append(current)
            current = []
        else:
            current.append(m)
    return rounds + [current]


def regenerate(engine, tokenizer, records: list[dict], sampling, *, split_name: str, template_kwargs: dict,
               markers: Markers | None, multi_turn: str) -> list[dict]:
    """Trace rows of prompt records: the target answers the last user turn (`last`), or every assistant turn in
    order, each conditioned on the regenerated history (`all`). Turns of all records run as one engine batch."""
    from .chat import render_chat

    if multi_turn not in ("last", "all"):
        raise ValueError(f"config key generation.multi_turn: {multi_turn!r}; use 'last' or 'all'")
    plans = [_rounds(json.loads(r["messages"]), multi_turn) for r in records]
    history = [[] for _ in records]
    turns: list[list[tuple[list[int], list[int]]]] = [[] for _ in records]
    last: list = [None] * len(records)
    for k in range(max(map(len, plans), default=0)):
        live = [i for i, plan in enumerate(plans) if k < len(plan) and (last[i] is None or not last[i].error)]
        prompts = []
        for i in live:
            history[i] = history[i] + plans[i][k]
            prompts.append(render_chat(tokenizer, history[i], template_kwargs))
        for i, gen in zip(live, engine.generate(prompts, sampling)):
            last[i] = gen
            turns[i].append((gen.prompt_ids, gen.output_ids))
            if k + 1 < len(plans[i]) and not gen.error:
                history[i] = history[i] + [history_message(split(tokenizer, markers, gen.prompt_ids, gen.output_ids))]
    rows = []
    for record, messages, gen, done in zip(records, history, last, turns):
        parts = split(tokenizer, markers, gen.prompt_ids, gen.output_ids) if not gen.error else Split("", "", "")
        rows.append({
            "id": record["id"], "split": split_name, "messages": json.dumps(messages, ensure_ascii=False),
            "prompt_ids": gen.prompt_ids, "output_ids": gen.output_ids,
            "text": tokenizer.decode(gen.output_ids, skip_special_tokens=False),
            "reasoning": parts.reasoning, "response": parts.response, "reasoning_status": parts.status,
            "loss_spans": loss_spans(done, list(gen.prompt_ids) + list(gen.output_ids)) if not gen.error else [],
            "turns": len(done), "finish_reason": gen.finish_reason, "prompt_tokens": len(gen.prompt_ids),
            "output_tokens": len(gen.output_ids), "error": gen.error,
        })
    return rows
