"""Streamed extraction (hidden_states.extract): the engine's batches of rows written at their offsets into the shard
while it is captured, resumable from the partial file. Its bytes must equal the whole-tensor path's (write_shard of
the concatenated per-chunk captures, what the stage wrote before), on the reference and the fast path (CPU: the
fast path's ring of host buffers runs unpinned through the same code)."""

import contextlib
import logging

import pytest
import torch

from eaglepipe.engines import open_engine
from eaglepipe.engines.base import EngineSettings
from eaglepipe.engines.transformers import _Ring
from eaglepipe.formats import sha256_tree
from eaglepipe.hidden_states import extract, runs_of, shard_tensors, write_shard
from eaglepipe.resume import Units

LAYERS = [1, 4, 8]


def data(count=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 26, (count,), generator=gen).tolist()
    seqs = [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in lengths]
    masks = [[int(j >= n // 2) for j in range(n)] for n in lengths]
    metadata = {"ids": [f"s{i}" for i in range(count)], "layer_ids": LAYERS, "layer_convention": "input_of_layer",
                "target_fingerprint": "tiny"}
    return seqs, masks, metadata


def settings(fast):
    # small batches: several per chunk (packed on the fast path, 3 sequences at most on the reference path)
    return EngineSettings(batch_size=3, max_batch_tokens=40, fast_path=fast)


def reference_sha(eng, seqs, masks, metadata, chunk_size, path):
    """The whole-tensor path: capture() per chunk, concatenate, save_file."""
    caps = []
    for a in range(0, len(seqs), chunk_size):
        caps += eng.capture(seqs[a: a + chunk_size], LAYERS)
    tensors = {**shard_tensors(seqs, masks), "aux": torch.cat([c.aux for c in caps]),
               "final": torch.cat([c.final for c in caps])}
    return write_shard(path, path.with_suffix(".json"), tensors, metadata)["sha256_tree"]


class CrashingEngine:
    """A real engine whose capture fails after `after` batches, as a job that dies mid-shard; counts what it is
    asked to capture."""

    def __init__(self, eng, after=None):
        self.eng, self.after, self.asked = eng, after, []

    def capture_rows(self, sequences, layer_ids, groups=None, dtype="bfloat16"):
        self.asked.append(len(sequences))
        with contextlib.closing(self.eng.capture_rows(sequences, layer_ids, groups, dtype)) as batches:
            for k, rows in enumerate(batches):
                if k == self.after:
                    rows.release()
                    raise RuntimeError("simulated crash")
                yield rows


@pytest.mark.parametrize("fast", [True, False])
def test_streamed_shard_is_byte_identical_to_whole_tensor_path(tmp_path, tiny_target, fast):
    seqs, masks, metadata = data()
    with open_engine(tiny_target, settings(fast)) as eng:
        assert (eng.fast is not None) == fast
        expected = reference_sha(eng, seqs, masks, metadata, 4, tmp_path / "ref.safetensors")
        out = tmp_path / "out.safetensors"
        digest = extract(eng, out, seqs, shard_tensors(seqs, masks), metadata, LAYERS, hidden=128, chunk_size=4,
                         units=Units(tmp_path / "progress", "k", "test"))
    assert digest == expected == sha256_tree(out)
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert not list(tmp_path.glob(".*partial"))


def test_empty_shard_equals_save_file(tmp_path, tiny_target):
    seqs, masks, metadata = [], [], {"ids": [], "layer_ids": LAYERS, "target_fingerprint": "tiny"}
    with open_engine(tiny_target, settings(True)) as eng:
        digest = extract(eng, tmp_path / "e.safetensors", seqs, shard_tensors(seqs, masks), metadata, LAYERS,
                         hidden=128, chunk_size=4)
    tensors = {**shard_tensors(seqs, masks), "aux": torch.zeros(0, 3, 128, dtype=torch.bfloat16),
               "final": torch.zeros(0, 128, dtype=torch.bfloat16)}
    assert digest == write_shard(tmp_path / "r.safetensors", tmp_path / "r.json", tensors, metadata)["sha256_tree"]


@pytest.mark.parametrize("fast", [True, False])
def test_a_crashed_extraction_resumes_from_its_partial_file(tmp_path, tiny_target, fast, caplog):
    seqs, masks, metadata = data(count=14, seed=1)
    out = tmp_path / "out.safetensors"
    small = shard_tensors(seqs, masks)
    with open_engine(tiny_target, settings(fast)) as eng:
        expected = reference_sha(eng, seqs, masks, metadata, 4, tmp_path / "ref.safetensors")
        after = 5 if fast else 2  # batches before the crash (the reference path's batches are whole chunks)
        crashing = CrashingEngine(eng, after=after)
        with pytest.raises(RuntimeError, match="simulated crash"):
            extract(crashing, out, seqs, small, metadata, LAYERS, hidden=128, chunk_size=4,
                    units=Units(tmp_path / "progress", "k", "test"))
        partial = tmp_path / ".out.safetensors.partial"
        assert partial.exists() and not out.exists()
        stored = sorted(p.name for p in (tmp_path / "progress").glob("unit-*.pt"))
        assert 1 <= len(stored) < 4, "the crash did not land mid-way"
        done_seqs = sum(min(4, 14 - 4 * int(name[5:11])) for name in stored)

        units = Units(tmp_path / "progress", "k", "test")
        resumed = CrashingEngine(eng)
        digest = extract(resumed, out, seqs, small, metadata, LAYERS, hidden=128, chunk_size=4, units=units)
        assert units.reused == len(stored)
        assert resumed.asked == [14 - done_seqs], "chunks already in the partial file were captured again"
        assert digest == expected == sha256_tree(out)
        assert not partial.exists()

        # Chunks recorded but the partial file gone: the records are discarded and everything is captured.
        out.unlink()
        with pytest.raises(RuntimeError, match="simulated crash"):
            extract(CrashingEngine(eng, after=after), out, seqs, small, metadata, LAYERS, hidden=128, chunk_size=4,
                    units=Units(tmp_path / "progress2", "k", "test"))
        (tmp_path / ".out.safetensors.partial").unlink()
        again = CrashingEngine(eng)
        with caplog.at_level(logging.INFO):
            digest = extract(again, out, seqs, small, metadata, LAYERS, hidden=128, chunk_size=4,
                             units=Units(tmp_path / "progress2", "k", "test"))
        assert "partial file" in caplog.text and again.asked == [14]
        assert digest == expected


def test_capture_rows_keeps_groups_apart_and_equals_capture(tiny_target):
    seqs, _, _ = data(count=9, seed=2)
    with open_engine(tiny_target, settings(True)) as eng:
        caps = eng.capture(seqs, LAYERS)
        seen, sizes = [], []
        for rows in eng.capture_rows(seqs, LAYERS, groups=[4, 0, 5]):
            assert all(i < 4 for i in rows.indices) or all(i >= 4 for i in rows.indices)
            # packed: consecutive sequences in order, within max_batch_tokens (40), or one alone
            assert rows.indices == list(range(rows.indices[0], rows.indices[-1] + 1))
            assert len(rows.indices) == 1 or sum(len(seqs[i]) for i in rows.indices) <= 40
            sizes.append(len(rows.indices))
            at = 0
            for i in rows.indices:
                n = len(seqs[i])
                groups_alone = eng.capture(seqs[:4] if i < 4 else seqs[4:], LAYERS)[i if i < 4 else i - 4]
                assert torch.equal(rows.aux[at: at + n], groups_alone.aux)
                torch.testing.assert_close(rows.final[at: at + n].float(), caps[i].final.float(), rtol=2e-2,
                                           atol=2e-2)
                at += n
            assert at == rows.aux.shape[0]
            seen += rows.indices
            rows.release()
        assert seen == list(range(9))  # in order: group 0 entirely first
        assert max(sizes) > 1  # some batch packs several sequences
        with pytest.raises(ValueError, match="do not add up"):
            list(eng.capture_rows(seqs, LAYERS, groups=[4, 4]))


def test_ring_slots_are_reused_only_after_release():
    ring = _Ring(2, rows=5, n_aux=3, hidden=4, pin=False)
    (a, *_), release_a = ring.take()
    (b, *_), _ = ring.take()
    assert a.data_ptr() != b.data_ptr()
    release_a()
    (again, *_), _ = ring.take()
    assert again.data_ptr() == a.data_ptr()  # allocated once, handed out in turn
    with pytest.raises(RuntimeError, match="release"):
        ring.take(patience=0.05)  # b was never released


def test_runs_merge_sequences_that_follow_each_other():
    lengths = [3, 1, 4, 0, 2]
    starts = [0, 3, 4, 8, 8, 10]
    assert runs_of([1, 2, 0], lengths, starts) == [(3, 0, 5), (0, 5, 3)]
    assert runs_of([3, 4, 0], lengths, starts) == [(8, 0, 2), (0, 2, 3)]


def test_a_sequence_cut_shorter_than_its_trace_keeps_a_mask_of_its_own_length():
    """A trace whose loss span reaches past the tokens kept (a response cut to fewer tokens, or
    hidden_states.max_length) gets a mask as long as its tokens: slice assignment past the end would lengthen the
    list and the shard's loss_mask would no longer match its input_ids."""
    from eaglepipe.hidden_states import loss_mask, sequences_of, shard_tensors

    assert loss_mask([3, 10], 6) == [0, 0, 0, 1, 1, 1] and loss_mask([8, 10], 6) == [0] * 6
    row = {"id": "a", "error": "", "prompt_ids": [1, 2, 3], "output_ids": [4, 5], "loss_spans": [3, 9]}
    ids, seqs, masks = sequences_of([row], max_length=100)
    assert seqs == [[1, 2, 3, 4, 5]] and masks == [[0, 0, 0, 1, 1]]
    small = shard_tensors(seqs, masks)
    assert small["loss_mask"].numel() == small["input_ids"].numel() == 5
    with pytest.raises(ValueError, match="sequence 0: 5 tokens but a loss mask of 4"):
        shard_tensors(seqs, [[0, 0, 1, 1]])
