"""Sampled traces (generation.temperature > 0): seeded, so a rerun gives the same bytes, on the transformers engine's
reference path and its fast path (engines/fast.py, forced on here on the CPU)."""

import json

import pytest
import torch

from eaglepipe import traces
from eaglepipe.formats import PROMPT_SCHEMA, TRACE_SCHEMA, read_table, write_table

PROMPTS = ["Name three rivers.", "Write a haiku about rain.", "What is 12 times 7?", "Describe a cat.",
           "List two colours.", "Say hello in French."]


def run(tmp_path, target, name, *, fast_path, temperature=0.7, top_p=0.9, seed=5) -> bytes:
    prompts = tmp_path / "prompts.parquet"
    if not prompts.exists():
        rows = [{"id": f"p{i}", "messages": json.dumps([{"role": "user", "content": p}]), "source": "test"}
                for i, p in enumerate(PROMPTS)]
        rows[0]["messages"] = json.dumps([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "x"},
                                          {"role": "user", "content": "Tell me more."}])
        write_table(prompts, rows, PROMPT_SCHEMA)
    out = tmp_path / name / "shard-0.parquet"
    out.parent.mkdir()
    traces.run(prompts, out, target_dir=target, split="eval", shard=0, num_shards=1,
               engine={"name": "transformers", "batch_size": 4, "threads": 1, "fast_path": fast_path},
               sampling={"max_new_tokens": 16, "temperature": temperature, "top_p": top_p, "seed": seed},
               template_kwargs={}, chunk_size=4, max_error_share=0.0, multi_turn="all")
    return out.read_bytes()


@pytest.mark.parametrize("fast_path", [False, True], ids=["reference", "fast"])
def test_same_seed_gives_the_same_sampled_traces_byte_for_byte(tmp_path, tiny_target, fast_path):
    """Two runs with one seed write the same trace shard, whatever the global generators hold before them (and the
    run leaves those untouched); another seed or greedy decoding writes other tokens."""
    torch.manual_seed(1)
    first = run(tmp_path, tiny_target, "first", fast_path=fast_path)
    state = torch.get_rng_state()
    torch.manual_seed(2)
    after = torch.get_rng_state()
    again = run(tmp_path, tiny_target, "again", fast_path=fast_path)
    assert first == again
    assert torch.equal(torch.get_rng_state(), after) and not torch.equal(state, after)
    run(tmp_path, tiny_target, "other", fast_path=fast_path, seed=6)
    run(tmp_path, tiny_target, "greedy", fast_path=fast_path, temperature=0.0)

    def tokens(name):
        return [r["output_ids"] for r in read_table(tmp_path / name / "shard-0.parquet", TRACE_SCHEMA)]

    assert tokens("first") != tokens("other") and tokens("first") != tokens("greedy")
    assert all(r["turns"] == (2 if r["id"] == "p0" else 1) and not r["error"]
               for r in read_table(tmp_path / "first" / "shard-0.parquet", TRACE_SCHEMA))
