"""The target fingerprint covers the weight bytes, each file hashed once per path, size and mtime."""

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

import eaglepipe.formats
from eaglepipe.target import fingerprint, read_fingerprint, write_fingerprint


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh hash cache, and the files whose bytes are read to hash them, in order."""
    monkeypatch.setenv("EAGLEPIPE_HASH_CACHE", str(tmp_path / "cache"))
    reads = []
    real = eaglepipe.formats.sha256_file

    def sha256_file(path):
        reads.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(eaglepipe.formats, "sha256_file", sha256_file)
    return reads


def perturb(weights, keep_mtime=False):
    """One tensor of the checkpoint changed in place, the file's size unchanged (a fine-tuned checkpoint saved over
    the old one); keep_mtime: then its mtime set back as it was."""
    stat = weights.stat()
    tensors = load_file(str(weights))
    name = next(k for k in sorted(tensors) if k.endswith("layers.0.mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert weights.stat().st_size == stat.st_size
    if keep_mtime:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_weights_are_hashed_once_per_size_and_mtime(tmp_path, tiny_target, counted):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    weights = target / "model.safetensors"
    first = fingerprint(target)
    assert counted == ["model.safetensors"]
    assert fingerprint(target) == first and counted == ["model.safetensors"]  # the cache, not the bytes
    perturb(weights)
    changed = fingerprint(target)
    assert changed != first and counted == ["model.safetensors"] * 2  # a new mtime: hashed again
    # Proof that an unchanged (path, size, mtime) is not read: bytes changed under the same mtime go unseen.
    perturb(weights, keep_mtime=True)
    assert fingerprint(target) == changed and counted == ["model.safetensors"] * 2


def test_the_fingerprint_file_moves_only_when_the_target_does(tmp_path, tiny_target, counted):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    path = tmp_path / "results/target/fingerprint.json"
    first = write_fingerprint(target, path)
    mtime = path.stat().st_mtime_ns
    assert write_fingerprint(target, path) == first and path.stat().st_mtime_ns == mtime
    perturb(target / "model.safetensors")
    assert write_fingerprint(target, path) == read_fingerprint(path) != first
