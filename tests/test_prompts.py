import json

import pytest

from eaglepipe import prompts
from eaglepipe.formats import read_table


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def run(tmp_path, sources, target, **kw):
    out = {"train": tmp_path / "out" / "train.parquet", "eval": tmp_path / "out" / "eval.parquet"}
    args = dict(eval_fraction=0.5, max_prompts=None, max_prompt_tokens=256, too_long="error", target_dir=target,
                system_prompt=None, template_kwargs={})
    args.update(kw)
    prompts.run([str(s) for s in sources], out, **args)
    return {split: read_table(path) for split, path in out.items()}


def test_three_forms_normalise_to_the_same_messages():
    m = prompts.normalise({"messages": [{"role": "user", "content": " Hi "}]}, "x")
    c = prompts.normalise({"conversations": [{"from": "human", "value": "Hi"}]}, "x")
    p = prompts.normalise({"prompt": "Hi"}, "x")
    assert m == c == p == [{"role": "user", "content": "Hi"}]


def test_trailing_assistant_turn_is_dropped_for_regeneration():
    msgs = prompts.normalise({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}, "x")
    assert msgs == [{"role": "user", "content": "Q"}]


def test_duplicates_removed_and_split_stable_when_prompts_are_added(tmp_path, smollm2):
    base = [{"prompt": f"question number {i}"} for i in range(30)]
    first = run(tmp_path / "a", [write_jsonl(tmp_path / "a.jsonl", base + base[:5])], smollm2)
    assert sum(map(len, first.values())) == 30  # the 5 repeats are gone
    more = base + [{"prompt": f"another question {i}"} for i in range(30)]
    second = run(tmp_path / "b", [write_jsonl(tmp_path / "b.jsonl", more)], smollm2)
    for split in ("train", "eval"):
        ids = {r["id"] for r in first[split]}
        assert ids <= {r["id"] for r in second[split]}, "adding prompts moved an existing prompt to another split"


def test_shipped_prompt_set_is_large_and_varied():
    records = prompts.read_records(prompts.default_source())
    assert len(records) >= 500
    contents = {json.dumps(prompts.normalise(r, "x")) for _, r in records}
    assert len(contents) == len(records)
    categories = {r["id"].split("-")[0] for _, r in records}
    assert {"code", "math", "reasoning", "writing", "multilingual", "chat"} <= categories


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "fine"}', '{"prompt": "broken'], "row 2: not valid JSON"),
        (['{"prompt": "fine"}', '{"text": "no messages here"}'], "row 2: no 'messages', 'conversations' or 'prompt'"),
        (['{"messages": [{"role": "user", "content": "   "}]}'], "row 1: the last user turn is empty"),
        (['{"prompt": "' + "word " * 400 + '"}'], "row 1: prompt is"),
    ],
    ids=["malformed-jsonl", "no-messages", "empty-prompt", "too-long"],
)
def test_bad_prompt_files_name_file_and_row_and_write_nothing(tmp_path, smollm2, lines, message):
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(prompts.PromptError, match=message) as err:
        run(tmp_path, [source], smollm2)
    assert str(source) in str(err.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_too_long_prompts_can_be_skipped(tmp_path, smollm2):
    lines = [{"prompt": f"short {i}"} for i in range(10)] + [{"prompt": "word " * 400}]
    out = run(tmp_path, [write_jsonl(tmp_path / "p.jsonl", lines)], smollm2, too_long="skip")
    assert sum(map(len, out.values())) == 10


def test_sharegpt_json_array_as_distributed(tmp_path, smollm2):
    """ShareGPT ships one JSON array of {"id", "conversations"}; the trailing gpt turn is dropped, earlier kept."""
    records = [
        {"id": "sg-1", "conversations": [{"from": "system", "value": "Be terse."},
                                         {"from": "human", "value": "Name a prime."},
                                         {"from": "gpt", "value": "7"},
                                         {"from": "human", "value": "Another?"},
                                         {"from": "gpt", "value": "11"}]},
        {"id": "sg-2", "conversations": [{"from": "human", "value": "What is rain?"},
                                         {"from": "gpt", "value": "Water falling."}]},
        {"id": "sg-3", "conversations": [{"from": "human", "value": "Say hi"}]},
    ]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records, indent=2))
    assert [row for row, _ in prompts.read_records(source)] == [1, 2, 3]
    assert prompts.count_records(source) == 3
    out = run(tmp_path, [source], smollm2)
    got = {r["id"]: json.loads(r["messages"]) for split in out.values() for r in split}
    assert got == {
        "sg-1": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."},
                 {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}],
        "sg-2": [{"role": "user", "content": "What is rain?"}],
        "sg-3": [{"role": "user", "content": "Say hi"}],
    }


def test_bad_json_array_names_the_record(tmp_path, smollm2):
    source = tmp_path / "bad.json"
    source.write_text(json.dumps([{"conversations": [{"from": "human", "value": "ok"}]}, ["not", "an", "object"]]))
    with pytest.raises(prompts.PromptError, match="record 2 of the array: expected a JSON object"):
        run(tmp_path, [source], smollm2)
    source.write_text('[{"prompt": "fine"}, {"prompt": "broken}]')
    with pytest.raises(prompts.PromptError, match=r"bad.json: not valid JSON .* line 1"):
        run(tmp_path, [source], smollm2)


def test_ultrachat_messages_parquet_as_distributed(tmp_path, smollm2):
    """UltraChat (HuggingFaceH4/ultrachat_200k) ships Parquet with prompt, prompt_id and messages columns (ids
    chosen to land one in each split)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    table = pa.table({
        "prompt": ["How do tides work?", "Plan a picnic."],
        "prompt_id": ["u-1", "u-4"],
        "messages": [[{"content": "How do tides work?", "role": "user"},
                      {"content": "The moon pulls the sea.", "role": "assistant"},
                      {"content": "And the sun?", "role": "user"},
                      {"content": "It pulls too, less.", "role": "assistant"}],
                     [{"content": "Plan a picnic.", "role": "user"},
                      {"content": "Bread, fruit, a blanket.", "role": "assistant"}]],
    }, schema=pa.schema([("prompt", pa.string()), ("prompt_id", pa.string()), ("messages", pa.list_(message))]))
    source = tmp_path / "ultrachat.parquet"
    pq.write_table(table, source)
    assert prompts.count_records(source) == 2
    out = run(tmp_path, [source], smollm2)
    got = {r["id"]: json.loads(r["messages"]) for split in out.values() for r in split}
    assert got == {
        "u-1": [{"role": "user", "content": "How do tides work?"},
                {"role": "assistant", "content": "The moon pulls the sea."},
                {"role": "user", "content": "And the sun?"}],
        "u-4": [{"role": "user", "content": "Plan a picnic."}],
    }
