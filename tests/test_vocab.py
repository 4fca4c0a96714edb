import torch

from eaglepipe import vocab
from eaglepipe.formats import TRACE_SCHEMA, write_table


def trace_row(i, output_ids, error=""):
    return {"id": str(i), "split": "train", "messages": "[]", "prompt_ids": [1, 2], "output_ids": output_ids,
            "text": "", "finish_reason": "stop", "prompt_tokens": 2, "output_tokens": len(output_ids), "error": error}


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
