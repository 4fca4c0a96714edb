"""Thinking targets, templates and masks on a tiny random model with a word-level tokenizer and a <think> template."""

import json
import random

import pytest
import torch

from eaglepipe import hidden_states, reasoning, traces, vocab
from eaglepipe.chat import load_tokenizer, render_chat
from eaglepipe.formats import PROMPT_SCHEMA, TRACE_SCHEMA, read_hidden_shard, read_table, write_table
from tiny_targets import WORDS, thinking_target

THINK = {"enable_thinking": True}
SAMPLING = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0, "seed": 0}
ENGINE = {"name": "transformers", "batch_size": 8, "threads": 1}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return thinking_target(tmp_path_factory.mktemp("targets") / "thinking")


@pytest.fixture(scope="module")
def tokenizer(target):
    return load_tokenizer(target)


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_file(path, n=40, multi_turn=0):
    rng = random.Random(0)
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": words(rng, 5)}]
        if i < multi_turn:  # an earlier exchange with an assistant answer as given
            messages = [{"role": "system", "content": "answer so"}, {"role": "user", "content": words(rng, 3)},
                        {"role": "assistant", "content": "given answer"}] + messages
        rows.append({"id": f"p{i:03d}", "messages": json.dumps(messages), "source": "test"})
    write_table(path, rows, PROMPT_SCHEMA)
    return path


def run_traces(tmp_path, target, multi_turn="last", n=40, multi=0):
    out = tmp_path / f"traces-{multi_turn}.parquet"
    traces.run(prompt_file(tmp_path / "prompts.parquet", n, multi), out, target_dir=target, split="train", shard=0,
               num_shards=1, engine=ENGINE, sampling=SAMPLING, template_kwargs=THINK, chunk_size=16,
               max_error_share=0.0, reasoning_markers=None, multi_turn=multi_turn)
    return read_table(out, TRACE_SCHEMA)


@pytest.fixture(scope="module")
def rows(tmp_path_factory, target):
    return run_traces(tmp_path_factory.mktemp("traces"), target)


def test_markers_are_detected_from_the_template(tokenizer):
    assert reasoning.resolve_markers(None, tokenizer) == reasoning.Markers("<think>", "</think>")
    assert reasoning.resolve_markers(False, tokenizer) is None


def test_stored_stream_is_what_the_template_renders(rows, tokenizer):
    end = tokenizer.convert_tokens_to_ids("</think>")
    finished = [r for r in rows if r["finish_reason"] == "stop" and end in r["output_ids"]]
    assert finished, "the sampled random model never closed its reasoning: the round trip was not exercised"
    for row in rows:
        messages = json.loads(row["messages"])
        assert render_chat(tokenizer, messages, THINK) == row["prompt_ids"]
        assert row["prompt_ids"][-1] == tokenizer.convert_tokens_to_ids("<think>")  # pre-filled by the template
    for row in finished:  # the whole conversation, rendered with the parsed reasoning and response, is the stream
        answer = {"role": "assistant", "content": row["response"], "reasoning_content": row["reasoning"]}
        rendered = render_chat(tokenizer, json.loads(row["messages"]) + [answer], THINK, generation_prompt=False)
        assert rendered == row["prompt_ids"] + row["output_ids"], row["id"]
        assert row["text"] == tokenizer.decode(row["output_ids"]) and "</think>" in row["text"]


def test_reasoning_columns_and_statuses_follow_the_tokens(rows, tokenizer):
    end, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("</think>", "<|im_end|>"))
    statuses = {r["reasoning_status"] for r in rows}
    assert {"complete", "unterminated"} <= statuses, statuses
    for row in rows:
        out = row["output_ids"]
        if end in out:
            cut = out.index(end)
            assert row["reasoning_status"] == "complete"
            assert row["reasoning"] == tokenizer.decode(out[:cut], skip_special_tokens=True).strip()
            assert row["response"] == tokenizer.decode([t for t in out[cut + 1:] if t != eos]).strip()
        else:
            assert row["reasoning_status"] == "unterminated" and row["response"] == ""


def test_stats_count_what_the_rows_hold(rows, tokenizer):
    end = tokenizer.convert_tokens_to_ids("</think>")
    got = reasoning.stats(rows)
    closed = [r for r in rows if end in r["output_ids"]]
    cut_off = [r for r in rows if end not in r["output_ids"] and r["finish_reason"] == "length"]
    assert got["reasoning_capture_rate"] == len(closed) / len(rows)
    assert got["truncated_in_reasoning_share"] == len(cut_off) / len(rows)
    assert got["empty_responses"] == sum(not r["response"] for r in closed)


def test_stats_count_planted_failures():
    def row(status, response="ok", finish="stop", error=""):
        return {"reasoning_status": status, "response": response, "finish_reason": finish, "error": error,
                "turns": 1, "loss_spans": [3, 9], "prompt_tokens": 3}

    rows = [row("complete"), row("complete"), row("complete", response=""),  # thought, then said nothing
            row("unterminated", response="", finish="length"),  # cut off while thinking
            row("unterminated", response="", finish="stop"),  # stopped without closing its reasoning
            row("absent"), row("", response="", error="engine rejected the request")]
    got = reasoning.stats(rows)
    assert got["responses"] == 6 and got["errors"] == 1
    assert got["reasoning_capture_rate"] == 3 / 6
    assert got["reasoning_unterminated"] == 2 and got["truncated_in_reasoning_share"] == 1 / 6
    assert got["empty_responses"] == 1 and got["reasoning_absent"] == 1


def test_split_reads_markers_from_prompt_or_output(tokenizer):
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)
    markers = reasoning.Markers("<think>", "</think>")
    prefilled = reasoning.split(tokenizer, markers, ids("assistant <think>"), ids("so yes </think> five <|im_end|>"))
    assert prefilled == reasoning.Split("so yes", "five", "complete")
    explicit = reasoning.split(tokenizer, markers, ids("assistant"), ids("<think> maybe </think> no <|im_end|>"))
    assert explicit == reasoning.Split("maybe", "no", "complete")
    assert reasoning.split(tokenizer, markers, ids("assistant"), ids("hello <|im_end|>")).status == "absent"
    assert reasoning.split(tokenizer, markers, ids("<think>"), ids("so so")) == reasoning.Split("so so", "",
                                                                                               "unterminated")
    # A closed empty reasoning in the prompt (thinking off) does not open a segment.
    assert reasoning.split(tokenizer, markers, ids("<think> </think>"), ids("yes <|im_end|>")).status == "absent"


def test_loss_mask_is_exactly_the_generated_positions(rows, target, tokenizer, tmp_path):
    trace = tmp_path / "t.parquet"
    write_table(trace, rows, TRACE_SCHEMA)
    shard = tmp_path / "h.safetensors"
    hidden_states.run(trace, shard, target_dir=target, layer_ids=None, engine=ENGINE, max_length=512, chunk_size=16)
    tensors, meta = read_hidden_shard(shard)
    cu = tensors["cu_seqlens"].tolist()
    by_id = {r["id"]: r for r in rows}
    for s, row_id in enumerate(meta["ids"]):
        row = by_id[row_id]
        tokens = tensors["input_ids"][cu[s]: cu[s + 1]].tolist()
        mask = tensors["loss_mask"][cu[s]: cu[s + 1]].tolist()
        assert tokens == row["prompt_ids"] + row["output_ids"]
        assert mask == [0] * len(row["prompt_ids"]) + [1] * len(row["output_ids"])
    assert meta["layer_ids"] == [2, 4, 5]  # (2, N//2, N-3) of the 8-layer target
    # `last`: the vocab counts are those of the output tokens, as before loss spans were counted.
    outputs = torch.tensor([t for r in rows if not r["error"] for t in r["output_ids"]])
    size = len(tokenizer)
    assert torch.equal(vocab.count_tokens([str(trace)], size), torch.bincount(outputs, minlength=size))


def trained_tokens(rows, size):
    """Counts of the tokens the draft learns: under the hidden-state loss mask (no truncation)."""
    _, seqs, masks = hidden_states.sequences_of(rows, 10 ** 9)
    learned = [t for seq, mask in zip(seqs, masks) for t, m in zip(seq, mask) if m]
    return torch.bincount(torch.tensor(learned), minlength=size)


def test_multi_turn_all_regenerates_each_turn_on_the_regenerated_history(target, tokenizer, tmp_path):
    rows = run_traces(tmp_path, target, "all", n=12, multi=12)
    last_rows = {r["id"]: r for r in run_traces(tmp_path, target, "last", n=12, multi=12)}
    masked_earlier = 0
    for row in rows:
        messages = json.loads(row["messages"])
        assert row["turns"] == 2 and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert messages[2]["content"] != "given answer"  # regenerated, not kept
        assert "given answer" in json.loads(last_rows[row["id"]]["messages"])[2]["content"]
        assert render_chat(tokenizer, messages, THINK) == row["prompt_ids"]
        stream = row["prompt_ids"] + row["output_ids"]
        spans = row["loss_spans"]
        assert spans[-2:] == [len(row["prompt_ids"]), len(stream)]
        if len(spans) == 4:  # the first turn's tokens sit in the stream exactly as generated, after its own prompt
            masked_earlier += 1
            assert stream[: spans[0]] == render_chat(tokenizer, messages[:2], THINK)
            reply = tokenizer.decode(stream[spans[0]: spans[1]])
            assert messages[2]["content"] in reply and messages[2].get("reasoning_content", "") in reply
    assert masked_earlier, "no earlier turn was masked: the multi-turn mask was not exercised"
    assert reasoning.stats(rows)["earlier_turns_masked"] == masked_earlier
    assert all(len(r["loss_spans"]) == 2 for r in last_rows.values())  # `last`: only the final turn is learned
    # The draft vocabulary is counted over the same tokens the draft learns: earlier regenerated turns included.
    size = len(tokenizer)
    freq = vocab.count_tokens([str(tmp_path / "traces-all.parquet")], size)
    assert torch.equal(freq, trained_tokens(rows, size))
    assert int(freq.sum()) > sum(len(r["output_ids"]) for r in rows if not r["error"])


def test_system_policy():
    conv = [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}]
    bare = conv[1:]
    assert reasoning.apply_system_policy(conv, "keep", "new") == conv
    assert reasoning.apply_system_policy(conv, "drop", None) == bare
    assert reasoning.apply_system_policy(conv, "replace", "new")[0]["content"] == "new"
    assert reasoning.apply_system_policy(bare, "replace", "new")[0] == {"role": "system", "content": "new"}
    assert reasoning.apply_system_policy(conv, "add", "new") == conv
    assert reasoning.apply_system_policy(bare, "add", "new")[0]["content"] == "new"
    assert reasoning.apply_system_policy(bare, "add", None) == bare
    with pytest.raises(ValueError, match="system_policy is 'replace' but prompts.system_prompt is null"):
        reasoning.apply_system_policy(conv, "replace", None)


def test_template_override_is_used_and_checked(target, tmp_path):
    good = tmp_path / "plain.jinja"
    good.write_text("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    tokenizer = load_tokenizer(target, reasoning.read_template(good))
    ids = render_chat(tokenizer, [{"role": "user", "content": "hello"}])
    assert tokenizer.decode(ids) == "<|im_start|> user hello <|im_end|> <|im_start|> assistant"
    assert reasoning.resolve_markers(None, tokenizer) is None  # this template has no thinking markers
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"target.chat_template: .*bad.jinja, line 1: not a valid Jinja template"):
        reasoning.read_template(bad)
    with pytest.raises(ValueError, match="target.chat_template: .* is not a file"):
        reasoning.read_template(tmp_path / "missing.jinja")
