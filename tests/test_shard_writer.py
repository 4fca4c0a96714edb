"""The streaming shard writer (eaglepipe/shard_writer.py) writes the bytes safetensors' own save_file writes."""

import pytest
import torch

from eaglepipe.formats import read_hidden_shard, write_hidden_shard
from eaglepipe.shard_writer import StreamingShard


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
    import hashlib
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
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
