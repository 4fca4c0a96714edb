"""The streaming shard writer (eaglepipe/shard_writer.py) writes the bytes safetensors' own save_file writes, and
hashes them as formats.sha256_tree defines. Each test runs with the real 16 MiB hash blocks (one block: these shards
are small) and with 64-byte blocks, which cut through every tensor and are completed out of order."""

import hashlib
import shutil
import subprocess

import pytest
import torch

import eaglepipe.formats as formats
import eaglepipe.shard_writer as sw
from eaglepipe.formats import read_hidden_shard, sha256_tree, write_hidden_shard
from eaglepipe.shard_writer import StreamingShard


@pytest.fixture(autouse=True, params=[formats.TREE_BLOCK, 64], ids=["16MiB-blocks", "64B-blocks"])
def block(request, monkeypatch):
    monkeypatch.setattr(formats, "TREE_BLOCK", request.param)
    monkeypatch.setattr(sw, "TREE_BLOCK", request.param)
    return request.param


def tree(data: bytes) -> str:
    """The definition, written out: sha256 over the blocks' sha256 digests."""
    size = formats.TREE_BLOCK
    return hashlib.sha256(b"".join(hashlib.sha256(data[at: at + size]).digest()
                                   for at in range(0, len(data), size))).hexdigest()


def shard_tensors(lengths, n_aux=3, hidden=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return {
        "input_ids": torch.randint(0, 1000, (t,), generator=gen, dtype=torch.int32),
        "loss_mask": (torch.rand(t, generator=gen) > 0.5).to(torch.uint8),
        "cu_seqlens": torch.tensor([0] + lengths).cumsum(0),
        "aux": torch.randn(t, n_aux, hidden, generator=gen).to(torch.bfloat16),
        "final": torch.randn(t, hidden, generator=gen).to(torch.bfloat16),
    }


META = {"ids": ["a", "b", "é-unicode", "d"], "layer_ids": [2, 4, 5], "layer_convention": "input_of_layer"}


def test_streamed_shard_equals_save_file_bytes(tmp_path):
    tensors = shard_tensors([5, 17, 1, 9])
    write_hidden_shard(tmp_path / "ref.safetensors", tensors, META)
    out = tmp_path / "streamed.safetensors"
    shard = StreamingShard(out, input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"],
                           cu_seqlens=tensors["cu_seqlens"], n_aux=3, hidden=8, metadata=META, queue_depth=1)
    for start, stop in [(0, 5), (5, 22), (22, 23), (23, 32)]:
        shard.write(start, tensors["aux"][start:stop], tensors["final"][start:stop])
    digest = shard.close()
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert digest == tree(out.read_bytes()) == sha256_tree(out)
    loaded, meta = read_hidden_shard(out)
    assert meta == META and torch.equal(loaded["aux"], tensors["aux"])
    assert not list(tmp_path.glob(".*partial"))


def test_incomplete_or_failed_shard_leaves_no_output(tmp_path):
    tensors = shard_tensors([4, 4])
    out = tmp_path / "s.safetensors"
    kwargs = dict(input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"], cu_seqlens=tensors["cu_seqlens"],
                  n_aux=3, hidden=8, metadata=META)
    shard = StreamingShard(out, **kwargs)
    shard.write(0, tensors["aux"][:4], tensors["final"][:4])
    with pytest.raises(RuntimeError, match="4 of 8 rows written"):
        shard.close()
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="do not fit"):
        with StreamingShard(out, **kwargs) as shard:
            shard.write(6, tensors["aux"][:4], tensors["final"][:4])
    assert not out.exists() and not list(tmp_path.iterdir())


def kwargs_of(tensors, **extra):
    return dict(input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"], cu_seqlens=tensors["cu_seqlens"],
                n_aux=3, hidden=8, metadata=META, **extra)


def test_scattered_runs_release_their_buffers_and_marks_follow_the_writes(tmp_path):
    """Rows arrive out of order (a length-sorted batch), from buffers the writer hands back; a mark's callback runs
    only after every row written before it."""
    tensors = shard_tensors([5, 17, 1, 9])
    write_hidden_shard(tmp_path / "ref.safetensors", tensors, META)
    out = tmp_path / "s.safetensors"
    released, marked = [], []
    shard = StreamingShard(out, **kwargs_of(tensors))
    order = [2, 0, 3, 1]  # sequences by length, as a batch holds them
    starts = tensors["cu_seqlens"].tolist()
    pieces = [slice(starts[i], starts[i + 1]) for i in order]
    aux = torch.cat([tensors["aux"][p] for p in pieces])
    final = torch.cat([tensors["final"][p] for p in pieces])
    runs, row = [], 0
    for p in pieces:
        runs.append((p.start, row, p.stop - p.start))
        row += p.stop - p.start
    shard.write_runs(runs[:2], aux, final, release=lambda: released.append(1))
    shard.mark(lambda: marked.append(shard.frontier))
    shard.write_runs(runs[2:], aux, final, release=lambda: released.append(2))
    digest = shard.close()
    assert released == [1, 2] and marked and marked[0] >= 0
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert digest == tree(out.read_bytes())


def test_a_kept_partial_is_reopened_without_truncation_and_another_is_not(tmp_path):
    tensors = shard_tensors([6, 10])
    write_hidden_shard(tmp_path / "ref.safetensors", tensors, META)
    out = tmp_path / "s.safetensors"
    with pytest.raises(KeyboardInterrupt):
        with StreamingShard(out, **kwargs_of(tensors, keep_partial=True)) as shard:
            shard.write(0, tensors["aux"][:6], tensors["final"][:6])
            raise KeyboardInterrupt  # the job dies after the first sequence
    assert (tmp_path / ".s.safetensors.partial").exists() and not out.exists()
    shard = StreamingShard(out, **kwargs_of(tensors, keep=[(0, 6)]))
    assert shard.kept == [(0, 6)]
    shard.write(6, tensors["aux"][6:], tensors["final"][6:])  # only the missing rows
    digest = shard.close()
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert digest == tree(out.read_bytes())
    # A partial of another shard (other token ids) is not taken: started over, so rows 0..5 must be written again.
    other = shard_tensors([6, 10], seed=1)
    with StreamingShard(out, **kwargs_of(other, keep_partial=True)) as shard:
        shard.write(0, other["aux"][:6], other["final"][:6])
        shard.close(ok=False)
    shard = StreamingShard(out, **kwargs_of(tensors, keep=[(0, 6)]))
    assert shard.kept == []
    shard.write(6, tensors["aux"][6:], tensors["final"][6:])
    with pytest.raises(RuntimeError, match="0 of 16 rows written"):
        shard.close()


def test_writes_are_synced_every_flush_bytes_not_only_at_close(tmp_path, monkeypatch):
    """Without marks, the writer still has the syncer fdatasync each time flush_bytes more have been written, so dirty
    pages go to disk during capture instead of all at close (which fsyncs; fdatasync is only the syncer's)."""
    import eaglepipe.shard_writer as sw

    calls = []
    real = sw.os.fdatasync
    monkeypatch.setattr(sw.os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    tensors = shard_tensors([40, 40, 40, 40], n_aux=3, hidden=8)
    row = (3 + 1) * 8 * 2  # bytes of one row: 3 aux states and the final one, bf16
    for flush_rows, syncs in ((1000, 0), (70, 2)):  # 160 rows in writes of 20: past 80 and 160 rows with 70
        calls.clear()
        path = tmp_path / f"s{flush_rows}.safetensors"
        shard = StreamingShard(path, input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"],
                               cu_seqlens=tensors["cu_seqlens"], n_aux=3, hidden=8, metadata=META,
                               flush_bytes=flush_rows * row)
        for start in range(0, 160, 20):
            shard.write(start, tensors["aux"][start:start + 20], tensors["final"][start:start + 20])
        digest = shard.close()
        if syncs:
            assert 1 <= len(calls) <= syncs  # the syncer merges flushes queued while it syncs
        else:
            assert calls == []
        assert digest == tree(path.read_bytes())


def test_rows_written_twice_fail_the_shard(tmp_path):
    """Every byte is counted into its hash block once: a second write of the same rows would let a block be hashed
    before (or after) its final bytes, so the writer refuses it and leaves no shard."""
    tensors = shard_tensors([4, 4])
    out = tmp_path / "s.safetensors"
    shard = StreamingShard(out, **kwargs_of(tensors))
    shard.write(0, tensors["aux"][:4], tensors["final"][:4])
    shard.write(0, tensors["aux"][:4], tensors["final"][:4])
    shard.write(4, tensors["aux"][4:], tensors["final"][4:])
    with pytest.raises(RuntimeError, match="written twice"):
        shard.close()
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(not (shutil.which("split") and shutil.which("xxd")), reason="needs coreutils split and xxd")
def test_sha256_tree_is_what_the_documented_shell_line_computes(tmp_path, block):
    if block != formats.TREE_BLOCK:
        pytest.skip("the shell line uses the real block size")
    path = tmp_path / "f.bin"
    path.write_bytes(torch.randint(0, 256, (2 * block + 12345,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    shell = subprocess.run(f"split -b {block} --filter='sha256sum | head -c 64 | xxd -r -p' {path} | sha256sum",
                           shell=True, check=True, capture_output=True, text=True).stdout.split()[0]
    assert sha256_tree(path) == sha256_tree(path, threads=1) == shell == tree(path.read_bytes())
