"""Finding the largest micro-batch that fits (the search), and the CPU behaviour."""

from __future__ import annotations

import pytest
import torch

from raydiff.training.microbatch import largest_fitting, measure_micro_batch


@pytest.mark.parametrize("limit, upper, expected", [(37, 128, 37), (1, 64, 1), (0, 64, 0), (500, 64, 64),
                                                    (64, 64, 64), (63, 64, 63)])
def test_largest_fitting_finds_the_limit_in_few_tries(limit, upper, expected):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    assert largest_fitting(fits, upper) == expected
    assert len(tried) <= 2 * upper.bit_length() + 1 and max(tried) <= upper


def test_cpu_uses_the_whole_share_without_probing():
    model = torch.nn.Linear(2, 2)
    chosen = measure_micro_batch(model, None, torch.optim.AdamW(model.parameters()), share=48, shape=(1, 8, 8),
                                 device=torch.device("cpu"), autocast_dtype=None)
    assert chosen == 48
