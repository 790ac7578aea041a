from __future__ import annotations

import numpy as np
import pytest

from raydiff.data.order import SampleOrder, micro_batches, rank_share


def test_each_epoch_visits_every_sample_once():
    order = SampleOrder(10, seed=3)
    first, _ = order.take(0, 10)
    second, _ = order.take(10, 10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert not np.array_equal(first, second)  # a new permutation every epoch


def test_order_is_a_pure_function_of_seed_and_position():
    a, fa = SampleOrder(100, seed=1).take(250, 37)  # spans an epoch boundary
    b, fb = SampleOrder(100, seed=1).take(250, 37)
    c, _ = SampleOrder(100, seed=2).take(250, 37)
    assert np.array_equal(a, b) and np.array_equal(fa, fb) and not np.array_equal(a, c)
    whole, _ = SampleOrder(100, seed=1).take(0, 400)
    assert np.array_equal(whole[250:287], a)  # reading from the middle gives the same stream


def test_flips_are_about_half():
    _, flips = SampleOrder(10_000, seed=0).take(0, 10_000)
    assert 0.45 < flips.mean() < 0.55


@pytest.mark.parametrize("global_batch, world", [(64, 1), (64, 2), (64, 3), (10, 4), (7, 7)])
def test_shares_tile_the_global_batch(global_batch, world):
    shares = [rank_share(global_batch, world, r) for r in range(world)]
    covered = [p for s in shares for p in range(s.offset, s.offset + s.size)]
    assert covered == list(range(global_batch))
    assert max(s.size for s in shares) - min(s.size for s in shares) <= 1


def test_step_samples_do_not_depend_on_world_size():
    order, global_batch, step = SampleOrder(50, seed=0), 12, 7
    reference, _ = order.take(step * global_batch, global_batch)
    for world in (1, 2, 3, 5):
        parts = []
        for rank in range(world):
            share = rank_share(global_batch, world, rank)
            for offset, size in micro_batches(share, micro_batch=2):
                parts.append(order.take(step * global_batch + offset, size)[0])
        assert np.array_equal(np.concatenate(parts), reference)


def test_micro_batches_cover_the_share():
    share = rank_share(10, 1, 0)
    assert micro_batches(share, 4) == [(0, 4), (4, 4), (8, 2)]
    with pytest.raises(ValueError):
        rank_share(4, 5, 0)


def test_a_subset_order_never_visits_held_out_samples():
    train = np.array([0, 2, 3, 5, 8, 9])
    indices, _ = SampleOrder(train, seed=4).take(0, 3 * len(train))
    for epoch in range(3):
        assert sorted(indices[epoch * 6:(epoch + 1) * 6]) == train.tolist()
    # The full range as an array is the same stream as the plain count.
    assert np.array_equal(SampleOrder(np.arange(10), seed=4).take(0, 25)[0], SampleOrder(10, seed=4).take(0, 25)[0])
