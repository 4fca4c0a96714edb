"""Validation names a damaged hidden-state shard: flipped bytes, truncation, planted NaN, foreign tokens."""

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import snakemake, tiny_config
from eaglepipe import validate
from eaglepipe.formats import sha256_file

SHARD = "results/hidden_states/train/shard-0.safetensors"


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target):
    workdir = tmp_path_factory.mktemp("validate")
    snakemake(workdir, tiny_config(tiny_target), "results/hidden_states/validation.json")
    return workdir


def check(workdir, tmp_path, damage, rehash=False):
    """Copy the run, damage train shard 0, validate the copy. rehash: the damage happened before the manifest
    was written (e.g. NaN from the extraction itself), so the manifest's checksum matches the damaged file."""
    copy = tmp_path / "run"
    shutil.copytree(workdir / "results", copy / "results")
    damage(copy / SHARD)
    manifest = json.loads((copy / "results/hidden_states/manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["path"] = str(copy / entry["path"])
        if rehash and entry["path"].endswith(SHARD):
            entry["sha256"] = sha256_file(entry["path"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    traces = {f"{p.parent.name}/{p.stem}": str(p) for p in (copy / "results/traces").rglob("*.parquet")}
    validate.run(copy / "manifest.json", traces, copy / "validation.json", max_length=128)


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


def test_flipped_bytes_fail_the_checksum(built, tmp_path):
    def flip(shard):
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF
        shard.write_bytes(bytes(data))

    with pytest.raises(validate.ShardError, match=r"train/shard-0.safetensors: sha256 .* differs from the manifest"):
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
