"""train.data_fraction: training on a seeded share of each shard's sequences, nested across shares; the full share
leaves the training order exactly as it was."""

import pytest
import torch

from eaglepipe import config as eaglepipe_config
from eaglepipe import train

CUS = [torch.tensor([0, 5, 9, 20, 21, 30, 44, 50, 61, 70, 75]), torch.tensor([0, 3, 8, 12, 30, 33, 40])]


def settings(**changes):
    return {**eaglepipe_config.validate({})["train"], "max_batch_tokens": 16, **changes}


def test_shares_are_nested_seeded_subsets():
    quarter, half = (train.kept_sequences(CUS, settings(data_fraction=f)) for f in (0.25, 0.5))
    assert [len(k) for k in quarter] == [max(1, round(0.25 * 10)), max(1, round(0.25 * 6))]
    assert [len(k) for k in half] == [5, 3]
    assert all(set(q) <= set(h) for q, h in zip(quarter, half))
    assert train.kept_sequences(CUS, settings(data_fraction=0.5)) == half  # the seed alone decides
    assert train.kept_sequences(CUS, settings(data_fraction=0.5, seed=1)) != half
    assert train.kept_sequences(CUS, settings()) is None


def test_schedule_at_a_share_trains_exactly_the_kept_sequences_in_the_full_orders_relative_order():
    full = train.schedule(CUS, settings(epochs=2))
    half = train.schedule(CUS, settings(epochs=2, data_fraction=0.5))
    kept = train.kept_sequences(CUS, settings(data_fraction=0.5))
    for epoch in range(2):
        for s in range(2):
            seen = [i for e, shard, seqs in half if (e, shard) == (epoch, s) for i in seqs]
            assert sorted(seen) == kept[s]
            everything = [i for e, shard, seqs in full if (e, shard) == (epoch, s) for i in seqs]
            assert seen == [i for i in everything if i in set(kept[s])]
    assert train.schedule(CUS, settings(epochs=2, data_fraction=1.0)) == full


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_out_of_range_share_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match="train.data_fraction"):
        eaglepipe_config.validate({"train": {"data_fraction": bad}})
