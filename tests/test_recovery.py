"""Recovery on a finished run of the real workflow: weights changed in place re-run the traces onward, and the command
each error advises, followed as written, leaves a complete run."""

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import planned_rules, snakemake, tiny_config

SHARD = "results/hidden_states/train/shard-0.safetensors"
OUTPUTS = ["results/hidden_states/validation.json", "results/draft/model.safetensors", "results/eval/acceptance.json",
           "results/export/checks.json", "results/bench/served.json", "results/report/summary.md"]
DOWNSTREAM = {"traces", "vocab", "hidden_states", "manifest", "validate_shards", "train", "evaluate", "export", "bench"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_target):
    """A finished default run on a target of its own (the weight test changes it in place, then restores it)."""
    root = tmp_path_factory.mktemp("recovery")
    target = root / "target"
    shutil.copytree(tiny_target, target)
    config = tiny_config(target)
    snakemake(root / "run", config)
    return root / "run", config, target


def copy_of(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)  # with Snakemake's metadata: a finished run, as a user has it
    return run


def test_weights_changed_in_place_rerun_the_traces_onward(finished, tmp_path):
    run, config, target = copy_of(finished, tmp_path), finished[1], finished[2]
    assert planned_rules(run, config) == set(), "the copied run is not finished"
    recorded = json.loads((run / "results/target/fingerprint.json").read_text())["target_fingerprint"]
    weights = target / "model.safetensors"
    backup = tmp_path / "model.safetensors"
    shutil.copy2(weights, backup)
    try:
        tensors = load_file(str(weights))
        name = next(k for k in sorted(tensors) if k.endswith("layers.0.mlp.down_proj.weight"))
        tensors[name] = tensors[name] * 1.5
        save_file(tensors, str(weights), metadata={"format": "pt"})
        planned = planned_rules(run, config)
    finally:
        shutil.copy2(backup, weights)  # bytes and mtime as before: the cached digest holds again
    assert DOWNSTREAM <= planned and "prompts" not in planned, planned
    now = json.loads((run / "results/target/fingerprint.json").read_text())["target_fingerprint"]
    assert now != recorded


def damage_shard(run):
    path = run / SHARD
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    path.write_bytes(bytes(data))


def record_of_other_weights(run):
    path = run / "results/hidden_states/train/shard-1.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "target_fingerprint": "0123456789abcdef"}))


def draft_config_edited(run):
    path = run / "results/draft/config.json"
    config = json.loads(path.read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]
    path.write_text(json.dumps(config))


CASES = {
    "damaged-shard": (damage_shard, f"--forcerun {SHARD}`"),
    "record-of-other-weights": (record_of_other_weights,
                                "--forcerun results/hidden_states/train/shard-1.safetensors`"),
    "draft-config-edited": (draft_config_edited, "--forcerun train`"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_advised_command_leaves_a_complete_run(finished, tmp_path, case):
    run, config = copy_of(finished, tmp_path), finished[1]
    damage, advice = CASES[case]
    damage(run)
    failed = snakemake(run, config, check=False)
    assert failed.returncode != 0, f"the run went on after the damage:\n{failed.stderr[-3000:]}"
    # The console shows the failed job's log (profiles/default: show-failed-logs), advice included.
    commands = re.findall(r"`(snakemake [^`]+)`", failed.stdout + failed.stderr)
    assert commands and commands[0].endswith(advice.rstrip("`")), (failed.stdout + failed.stderr)[-3000:]
    args = commands[0].split()[1:]  # followed as written; the helper adds the run's -s, -d and --configfile
    snakemake(run, config, *args)
    assert planned_rules(run, config) == set()
    for path in OUTPUTS:
        assert (run / path).is_file(), path
    draft = json.loads((run / "results/draft/config.json").read_text())
    manifest = json.loads((run / "results/hidden_states/manifest.json").read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"]
    assert draft["eaglepipe"]["provenance"]["target_fingerprint"] == manifest["target_fingerprint"]
    assert set(draft["eaglepipe"]["provenance"]["target_parts"]) == {"config", "tokenizer", "weights",
                                                                     "transformers_version"}
