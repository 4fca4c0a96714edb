"""The production config dry-runs without its checkpoint and prints a plan; parse-time target checks."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, snakemake, tiny_config
from eaglepipe import estimate
from eaglepipe.config import validate

KIMI = yaml.safe_load((REPO / "config/kimi-k2.5.yaml").read_text())


def job_blocks(out: str) -> dict[str, list[str]]:
    """Dry-run job descriptions by rule name."""
    blocks: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=\[.*\d{4}\]\n)", out):
        rule = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if rule:
            blocks.setdefault(rule.group(1), []).append(block)
    return blocks


def test_production_config_dry_runs_without_checkpoint_and_prints_the_plan(tmp_path):
    assert not (REPO / KIMI["target"]["path"]).exists()  # the 1T checkpoint is not on this machine
    result = snakemake(tmp_path, KIMI, "-n")
    out = result.stdout + result.stderr
    blocks = job_blocks(out)
    shards = 2 * KIMI["generation"]["num_shards"]
    for rule in ("traces", "hidden_states", "bench"):
        assert blocks[rule] and all("gpu=8" in b for b in blocks[rule]), rule
    assert len(blocks["traces"]) == len(blocks["hidden_states"]) == shards
    assert all("gpu=" not in b for rule in ("vocab", "manifest", "prompts") for b in blocks[rule])
    info, p, g = KIMI["target"]["info"], KIMI["prompts"], KIMI["generation"]
    tokens = p["max_prompts"] * min(p["max_prompt_tokens"] + g["max_new_tokens"], KIMI["hidden_states"]["max_length"])
    total = tokens * ((len(KIMI["hidden_states"]["aux_layer_ids"]) + 1) * info["hidden_size"] * 2 + 4 + 1)
    assert "plan: target 61 layers, hidden 7168, vocab 163840, aux layer ids [2, 30, 58]" in out
    assert f"plan: prompts {p['max_prompts']}; tokens {tokens:,}" in out
    assert f"({total:,} bytes)" in out
    assert f"traces ({shards} jobs x gpu=8), hidden_states ({shards} jobs x gpu=8)" in out
    assert not (tmp_path / "results").exists()
    quiet = snakemake(tmp_path, KIMI, "-n", "--quiet")
    assert "plan:" not in quiet.stdout + quiet.stderr  # --quiet leaves the plan out



def test_real_run_without_checkpoint_fails_clearly(tmp_path):
    result = snakemake(tmp_path, KIMI, "results/prompts/train.parquet", check=False)
    assert result.returncode != 0
    assert "config key target.path: '/models/Kimi-K2.5' is not a checkpoint folder" in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("override, message", [
    ({"target": {"info": {"num_layers": 9, "hidden_size": 128, "vocab_size": 49152}}},
     "config key target.info disagrees with .*: num_layers is 9 in config but 8 in the checkpoint"),
    ({"hidden_states": {"aux_layer_ids": [2, 4, 9]}},
     r"aux_layer_ids: \[2, 4, 9\] must be 3 increasing ids in \[0, 7\]"),
    ({"prompts": {"system_policy": "replace"}}, "system_policy is 'replace' but prompts.system_prompt is null"),
    ({"target": {"chat_template": "/no/such.jinja"}},
     "config key target.chat_template: '/no/such.jinja' is not a file"),
], ids=["info-mismatch", "layer-beyond-depth", "replace-without-text", "missing-template"])
def test_bad_target_settings_are_named_at_parse_time(tmp_path, tiny_target, override, message):
    result = snakemake(tmp_path, tiny_config(tiny_target, **override), "-n", check=False)
    assert result.returncode != 0
    assert re.search(message, result.stdout + result.stderr)


def test_plan_takes_tokens_from_trace_stats_when_present(tmp_path):
    config = validate(json.loads(json.dumps(KIMI)))
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"train": {"prompt_tokens": 1000, "output_tokens": 3000},
                                 "eval": {"prompt_tokens": 100, "output_tokens": 300}}))
    plan = estimate.plan(config, stats_path=stats)
    assert plan["tokens"] == 4400 and plan["tokens_from"] == str(stats)
    assert plan["hidden_state_bytes"] == 4400 * (4 * 7168 * 2 + 5)  # bf16 states, int32 id, uint8 mask
    cli = subprocess.run([sys.executable, "-m", "eaglepipe.estimate", "--json", "--configfile",
                          str(REPO / "config/kimi-k2.5.yaml")], capture_output=True, text=True, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["hidden_state_bytes_per_token"] == 4 * 7168 * 2 + 5


def test_plan_counts_the_bytes_of_fp8_shards(tmp_path):
    config = validate({**json.loads(json.dumps(KIMI)), "hidden_states": {**KIMI["hidden_states"],
                                                                          "dtype": "float8_e4m3fn"}})
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"train": {"prompt_tokens": 1000, "output_tokens": 3000}}))
    plan = estimate.plan(config, stats_path=stats)
    # one byte per value, a float32 scale per layer row (3 aux + final), the id and the mask
    assert plan["hidden_state_bytes_per_token"] == 4 * 7168 + 4 * 4 + 5
    assert plan["hidden_state_bytes"] == 4000 * (4 * 7168 + 21)
    assert "in float8_e4m3fn" in estimate.format_plan(plan)
