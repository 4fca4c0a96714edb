"""Validation names a damaged hidden-state shard: flipped bytes, truncation, planted NaN, foreign tokens; a shard
damaged after a finished run fails the run against the sha256_tree its extraction job recorded, and no draft is
trained."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import snakemake, tiny_config
from eaglepipe import validate
from eaglepipe.formats import sha256_tree

SHARD = "results/hidden_states/train/shard-0.safetensors"
DRAFT = "results/draft/model.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target):
    """A finished small run up to the draft; tests damage copies of it."""
    workdir = tmp_path_factory.mktemp("validate")
    snakemake(workdir, tiny_config(tiny_target), DRAFT)
    return workdir


def flip_middle(shard, n=64):
    """The issue's corruption: 64 bytes in the middle of the file inverted."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle: middle + n] = bytes(b ^ 0xFF for b in data[middle: middle + n])
    shard.write_bytes(bytes(data))


def check(workdir, tmp_path, damage, rehash=False, threads=1):
    """Copy the run, damage train shard 0, validate the copy. rehash: the damage happened before the manifest
    was written (e.g. NaN from the extraction itself), so the manifest's checksum matches the damaged file."""
    copy = tmp_path / "run"
    shutil.copytree(workdir / "results", copy / "results")
    damage(copy / SHARD)
    manifest = json.loads((copy / "results/hidden_states/manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["path"] = str(copy / entry["path"])
        if rehash and entry["path"].endswith(SHARD):
            entry["sha256_tree"] = sha256_tree(entry["path"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    traces = {f"{p.parent.name}/{p.stem}": str(p) for p in (copy / "results/traces").rglob("*.parquet")}
    validate.run(copy / "manifest.json", traces, copy / "validation.json", max_length=128, threads=threads)


def rewrite(change):
    def damage(shard):
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(shard))
        change(tensors)
        save_file(tensors, str(shard), metadata=metadata)

    return damage


def test_intact_shards_pass(built, tmp_path):
    check(built, tmp_path, lambda shard: None)
    report = json.loads((tmp_path / "run/validation.json").read_text())
    assert len(report["shards"]) == 4 and all(s["ok"] for s in report["shards"])


def test_parallel_validation_reports_what_the_serial_one_does(built, tmp_path):
    check(built, tmp_path / "serial", lambda shard: None)
    check(built, tmp_path / "parallel", lambda shard: None, threads=4)
    serial, parallel = ([(str(Path(s["path"]).relative_to(tmp_path / name / "run")), s["sha256_tree"], s["tokens"])
                         for s in json.loads((tmp_path / f"{name}/run/validation.json").read_text())["shards"]]
                        for name in ("serial", "parallel"))
    assert len(serial) == 4 and serial == parallel
    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: sha256_tree .* differs"):
        check(built, tmp_path / "damaged", flip_middle, threads=4)


@pytest.mark.parametrize("block_rows", [1, 4, 7, 1 << 16])
def test_nan_scan_counts_and_places_across_blocks(built, tmp_path, block_rows):
    """The states are scanned a block of rows at a time: every block size finds all planted values and the first."""
    shard = tmp_path / "shard.safetensors"
    shutil.copy(built / SHARD, shard)

    def plant(t):
        t["final"][9, 0] = float("inf")
        t["final"][2, 4] = float("nan")
        t["final"][t["final"].shape[0] - 1, 1] = float("nan")

    rewrite(plant)(shard)
    with pytest.raises(validate.ShardError, match=r"3 NaN/Inf values in 'final', first at token 2$"):
        validate.check_finite(shard, "shard", block_rows=block_rows)
    shutil.copy(built / SHARD, shard)
    validate.check_finite(shard, "shard", block_rows=block_rows)


def test_flipped_bytes_fail_the_checksum(built, tmp_path):
    def flip(shard):
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))

    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: sha256_tree .* differs from the "
                       "manifest"):
        check(built, tmp_path, flip)
    assert not (tmp_path / "run/validation.json").exists()


def test_truncated_shard_is_unreadable(built, tmp_path):
    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: unreadable"):
        check(built, tmp_path, lambda shard: shard.write_bytes(shard.read_bytes()[:1000]), rehash=True)


def test_planted_nan_is_named_with_its_position(built, tmp_path):
    def plant(t):
        t["aux"][5, 1, 3] = float("nan")

    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: 1 NaN/Inf values in 'aux', first at "
                                                  r"token 5"):
        check(built, tmp_path, rewrite(plant), rehash=True)


def test_tokens_that_do_not_match_the_traces_are_named(built, tmp_path):
    def swap(t):
        t["input_ids"][3] += 1

    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: its tokens are not those of"):
        check(built, tmp_path, rewrite(swap), rehash=True)


def test_shard_damaged_after_a_finished_run_fails_it_and_trains_no_draft(built, tmp_path, tiny_target, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(built, run)  # with Snakemake's metadata: a finished run, as a user would have it
    record = json.loads((run / SHARD).with_suffix(".json").read_text())
    assert record["sha256_tree"] == sha256_tree(run / SHARD)
    draft = (run / DRAFT).read_bytes()
    draft_mtime = (run / DRAFT).stat().st_mtime_ns
    config = tiny_config(tiny_target)
    dry = snakemake(run, config, DRAFT, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr, f"the copied run is not finished:\n{dry.stdout[-3000:]}"
    old_log = (run / "logs/validate_shards.log").read_text()
    flip_middle(run / SHARD)
    result = snakemake(run, config, DRAFT, check=False)
    assert result.returncode != 0, f"the run went on with a damaged shard:\n{result.stderr[-3000:]}"
    log = (run / "logs/validate_shards.log").read_text().removeprefix(old_log)
    assert f"{SHARD}: sha256_tree" in log and f"re-extract it with `snakemake --cores all --forcerun {SHARD}`" in log
    assert f"{SHARD} ok" not in log
    # The manifest still holds what extraction wrote; the draft was neither retrained nor removed.
    manifest = json.loads((run / "results/hidden_states/manifest.json").read_text())
    assert [s["sha256_tree"] for s in manifest["shards"] if s["path"] == SHARD] == [record["sha256_tree"]]
    assert (run / DRAFT).read_bytes() == draft and (run / DRAFT).stat().st_mtime_ns == draft_mtime
    assert not (run / "results/hidden_states/validation.json").exists()
    # Training checks the bytes itself (a validation.json from before the damage does not let it through).
    monkeypatch.chdir(run)  # the workflow's paths are relative to its directory
    with pytest.raises(validate.ShardError, match=rf"{SHARD}: sha256_tree .* recorded by its hidden_states job"):
        validate.verify_shards("results/hidden_states/manifest.json", [SHARD])


def test_training_refuses_a_shard_missing_from_the_manifest(built, tmp_path):
    with pytest.raises(validate.ShardError, match=r"shard-9.safetensors: not listed in .*manifest.json"):
        validate.verify_shards(built / "results/hidden_states/manifest.json",
                               [str(built / "results/hidden_states/train/shard-9.safetensors")])
