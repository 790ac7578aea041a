"""Every random draw keyed: seeds that are pure functions of their key, and one generator per image."""

from __future__ import annotations

import torch

from raydiff.seeds import derive_seed, image_generators, keyed_rng


def test_a_seed_is_a_pure_function_of_its_key():
    assert derive_seed(0, 5, 7) == derive_seed(0, 5, 7)
    assert len({derive_seed(0, 5, 7), derive_seed(0, 5, 8), derive_seed(1, 5, 7), derive_seed(0, 6, 7)}) == 4
    assert 0 <= derive_seed(2**40, 3) < 2**63  # fits torch's manual_seed
    # Trailing zeros do not count (numpy's SeedSequence): streams are told apart by non-zero tags.
    assert keyed_rng(3, 1).random() == keyed_rng(3, 1, 0).random() != keyed_rng(3, 1, 5).random()


def test_image_i_draws_from_its_own_generator_whatever_the_batch():
    batch = image_generators(0, range(4), "cpu", tag=8)
    alone = image_generators(0, [2], "cpu", tag=8)
    assert torch.equal(torch.randn(5, generator=batch[2]), torch.randn(5, generator=alone[0]))
    other_tag = image_generators(0, [2], "cpu", tag=7)
    assert not torch.equal(torch.randn(5, generator=image_generators(0, [2], "cpu", 8)[0]),
                           torch.randn(5, generator=other_tag[0]))
