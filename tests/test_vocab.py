import torch

from eaglepipe import vocab
from eaglepipe.formats import TRACE_SCHEMA, write_table


def trace_row(i, output_ids, error="", prompt_ids=(1, 2), loss_spans=None):
    """A trace row; loss_spans default to what multi_turn `last` stores: exactly the output."""
    n = len(prompt_ids)
    spans = [n, n + len(output_ids)] if loss_spans is None and output_ids else loss_spans or []
    return {"id": str(i), "split": "train", "messages": "[]", "prompt_ids": list(prompt_ids), "output_ids": output_ids,
            "text": "", "loss_spans": spans, "finish_reason": "stop", "prompt_tokens": n,
            "output_tokens": len(output_ids), "error": error}


def test_vocab_map_follows_the_serving_convention(tmp_path):
    path = tmp_path / "t.parquet"
    # token 7 x3, 3 x2, 9 x2 (tie with 3: lower id wins), 5 x1; the errored row must not count
    write_table(path, [trace_row(0, [7, 7, 3, 9]), trace_row(1, [7, 3, 9, 5]), trace_row(2, [5, 5, 5], "boom")],
                TRACE_SCHEMA)
    vocab.run([str(path)], tmp_path / "map.safetensors", tmp_path / "cov.json", target_vocab=12,
              draft_vocab_size=2, curve_sizes=[1, 4])
    m = vocab.load(tmp_path / "map.safetensors")
    assert m["draft_ids"].tolist() == [3, 7]
    d2t = m["d2t"]
    assert [i + int(d2t[i]) for i in range(2)] == [3, 7]  # target_id = i + d2t[i]
    assert m["t2d"].nonzero().squeeze(1).tolist() == [3, 7]
    assert m["token_freq"][7] == 3 and m["token_freq"][5] == 1
    import json

    cov = json.loads((tmp_path / "cov.json").read_text())
    assert abs(cov["coverage"] - 5 / 8) < 1e-9
    assert [c["size"] for c in cov["curve"]] == [1, 2, 4]


def test_draft_vocab_larger_than_target_is_refused():
    import pytest

    with pytest.raises(ValueError, match="draft_vocab_size"):
        vocab.select(torch.ones(10, dtype=torch.int64), 11)


def test_earlier_generated_turns_count_and_given_prompt_tokens_do_not(tmp_path):
    import json

    # multi_turn `all`: prompt = [given 1 1] [generated 8 8 8] [given 2], output [4 4]; spans [2, 5) and [6, 8).
    row = trace_row(0, [4, 4], prompt_ids=[1, 1, 8, 8, 8, 2], loss_spans=[2, 5, 6, 8])
    path = tmp_path / "t.parquet"
    write_table(path, [row, trace_row(1, [4, 9])], TRACE_SCHEMA)
    vocab.run([str(path)], tmp_path / "map.safetensors", tmp_path / "cov.json", target_vocab=12,
              draft_vocab_size=1, curve_sizes=[2])
    freq = vocab.load(tmp_path / "map.safetensors")["token_freq"]
    # 8 x3 from the earlier turn counts as much as 4 x3 (4 wins the tie); the given 1 and 2 are never learned.
    assert freq.tolist() == [0, 0, 0, 0, 3, 0, 0, 0, 3, 1, 0, 0]
    assert vocab.load(tmp_path / "map.safetensors")["draft_ids"].tolist() == [4]
    cov = json.loads((tmp_path / "cov.json").read_text())
    assert cov["counted_tokens"] == 7 and abs(cov["coverage"] - 3 / 7) < 1e-9
    assert [c["coverage"] for c in cov["curve"]] == [3 / 7, 6 / 7]


def test_loss_spans_outside_the_stream_are_refused(tmp_path):
    import pytest

    path = tmp_path / "t.parquet"
    write_table(path, [trace_row("bad", [4, 4], loss_spans=[2, 9])], TRACE_SCHEMA)
    with pytest.raises(ValueError, match=r"t.parquet: row bad: loss_spans \[2, 9\] .* 4-token stream; rerun"):
        vocab.count_tokens([str(path)], 12)
