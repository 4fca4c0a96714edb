import torch

from eaglepipe.engines import open_engine
from eaglepipe.engines.base import EngineSettings, Sampling


def test_capture_numbers_layers_as_their_input_and_final_after_norm(tiny_target):
    from transformers import AutoModelForCausalLM

    seq = [1, 42, 7, 300, 9, 12]
    with open_engine(tiny_target, EngineSettings()) as eng:
        cap = eng.capture([seq], [0, 2, 3])[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for n, k in enumerate([0, 2, 3]):
        torch.testing.assert_close(cap.aux[:, n].float(), hs[k][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cap.final.float(), hs[-1][0], rtol=2e-2, atol=2e-2)
    assert not torch.allclose(cap.aux[:, 2].float(), hs[4][0], rtol=2e-2, atol=2e-2)  # id 3 is not layer 3's output


def test_batched_capture_and_generation_equal_one_by_one(tiny_target):
    seqs = [[1, 5, 9, 200, 31], [1, 77], [1, 8, 8, 8, 8, 8, 8, 8, 8]]
    with open_engine(tiny_target, EngineSettings(batch_size=8)) as eng:
        batched = eng.capture(seqs, [1, 2, 3])
        single = [eng.capture([s], [1, 2, 3])[0] for s in seqs]
        for b, s in zip(batched, single):
            torch.testing.assert_close(b.aux.float(), s.aux.float(), rtol=2e-2, atol=2e-2)
        gens = eng.generate(seqs, Sampling(max_new_tokens=6))
        alone = [eng.generate([s], Sampling(max_new_tokens=6))[0] for s in seqs]
    for g, a, s in zip(gens, alone, seqs):
        assert g.prompt_ids == s
        assert g.output_ids == a.output_ids
        assert g.finish_reason in ("stop", "length") and not g.error
        assert len(g.output_ids) == 6 or g.output_ids[-1] == 2


def test_failed_batch_retries_items_alone_but_fails_fast_on_a_shared_cause(tiny_target):
    """One bad item costs only itself; a batch whose items all fail alone too is failed at once, naming the cause,
    instead of retrying every item (hours on a large batch)."""
    seqs = [[1, 5, 9], [1, 666], [1, 8, 8, 8], [1, 2, 3], [1, 4]]
    with open_engine(tiny_target, EngineSettings(batch_size=8)) as eng:
        real = eng._generate_batch
        calls = []

        def bad_item(prompts, sampling, seed):
            calls.append(len(prompts))
            if [1, 666] in prompts:
                raise RuntimeError("item 666 is bad")
            return real(prompts, sampling, seed)

        eng._generate_batch = bad_item
        gens = eng.generate(seqs, Sampling(max_new_tokens=3))
        assert [bool(g.error) for g in gens] == [False, True, False, False, False]
        assert calls == [5, 1, 1, 1, 1, 1]

        def shared_cause(prompts, sampling, seed):
            calls.append(len(prompts))
            raise RuntimeError("CUDA error: out of memory")

        calls.clear()
        eng._generate_batch = shared_cause
        gens = eng.generate(seqs, Sampling(max_new_tokens=3))
        assert all("out of memory" in g.error for g in gens)
        assert calls == [5, 1, 1]  # the batch, then two items alone: a shared cause, so the rest fail at once


def test_a_batch_out_of_device_memory_runs_in_halves_not_item_by_item(tiny_target):
    """A batch the device cannot hold is split in halves until the parts fit (a 2,048-row batch past an 80 GB card's
    memory costs a few failed attempts, not 2,048 single-row generations), with the same tokens as unsplit (greedy)
    and the same samples on a rerun (the halves' seeds derive from the batch's)."""
    seqs = [[1, 5, 9], [1, 66], [1, 8, 8, 8], [1, 2, 3], [1, 4]]
    with open_engine(tiny_target, EngineSettings(batch_size=8)) as eng:
        whole = eng.generate(seqs, Sampling(max_new_tokens=4))
        real = eng._generate_batch
        calls = []

        def small_device(prompts, sampling, seed):
            calls.append(len(prompts))
            if len(prompts) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 306.00 MiB")
            return real(prompts, sampling, seed)

        eng._generate_batch = small_device
        split = eng.generate(seqs, Sampling(max_new_tokens=4))
        assert calls == [5, 2, 3, 1, 2]
        assert [g.output_ids for g in split] == [g.output_ids for g in whole]
        assert not any(g.error for g in split)

        sampled = [eng.generate(seqs, Sampling(max_new_tokens=4, temperature=1.0, seed=3)) for _ in range(2)]
        assert [g.output_ids for g in sampled[0]] == [g.output_ids for g in sampled[1]]

        def no_room(prompts, sampling, seed):  # not even one row fits: every item fails, and fast
            calls.append(len(prompts))
            raise torch.OutOfMemoryError("CUDA out of memory")

        calls.clear()
        eng._generate_batch = no_room
        failed = eng.generate(seqs, Sampling(max_new_tokens=4))
        assert all("out of memory" in g.error for g in failed)
        assert calls == [5, 2, 1, 1, 1]  # halves down to one row, then two items alone: a shared cause
