"""Trace statistics: the response length distribution and the responses that end in a loop (greedy decoding of a
small target often repeats a cycle to the token limit; those tokens are trivial to draft)."""

import json

import pytest

from eaglepipe import traces
from eaglepipe.formats import TRACE_SCHEMA, write_table

TEXT = list(range(100, 180))  # 80 tokens, no repetition


@pytest.mark.parametrize("ids,expected", [
    (TEXT, (0, 0)),
    (TEXT[:5] + [7, 8, 9] * 20, (3, 57)),          # a 3-token cycle, 20 times: 57 tokens repeat the first 3
    ([5] * 40, (1, 39)),
    (TEXT[:10] + [1, 2] * 10, (0, 0)),              # 20 looping tokens: under LOOP_MIN_TOKENS
    (TEXT[:10] + TEXT[:20] * 2, (0, 0)),            # a 20-token cycle seen twice: under LOOP_MIN_REPEATS
    (TEXT[:10] + TEXT[:20] * 3, (20, 40)),
    (TEXT[:3] + [4, 4, 5] * 15 + [6], (0, 0)),      # the cycle stops before the end: not a trailing loop
    ([], (0, 0)),
])
def test_trailing_loop(ids, expected):
    assert traces.trailing_loop(ids) == expected


def row(i, output_ids, split="train", finish="length", error=None):
    return {"id": f"q{i}", "split": split, "messages": "[]", "prompt_ids": [1, 2], "output_ids": output_ids,
            "text": "", "reasoning": "", "response": "x", "reasoning_status": "",
            "loss_spans": [2, 2 + len(output_ids)],
            "turns": 1, "finish_reason": finish, "prompt_tokens": 2, "output_tokens": len(output_ids), "error": error}


def test_stats_report_lengths_and_loops(tmp_path):
    rows = [row(0, TEXT[:40], finish="stop"), row(1, TEXT[:10] + [7, 8] * 25), row(2, TEXT[:60], finish="stop"),
            row(3, [], error="rejected: too long"), row(4, TEXT[:20], split="eval", finish="stop")]
    write_table(tmp_path / "shard-0.parquet", rows, TRACE_SCHEMA)
    traces.stats([str(tmp_path / "shard-0.parquet")], tmp_path / "stats.json")
    train = json.loads((tmp_path / "stats.json").read_text())["train"]
    assert train["responses"] == 3 and train["errors"] == 1
    assert train["response_tokens"] == {"mean": pytest.approx(160 / 3), "p10": 44.0, "p50": 60.0, "p90": 60.0,
                                        "p99": 60.0, "max": 60}
    assert train["looping_share"] == pytest.approx(1 / 3)
    assert train["looping_token_share"] == pytest.approx(48 / 160)  # 50 loop tokens, the first cycle (2) not counted
    assert train["truncated_share"] == pytest.approx(1 / 3)
