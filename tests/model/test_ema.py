from __future__ import annotations

import pytest
import torch

from raydiff.model.ema import EmaUpdater, ema_decay_at, make_ema


def test_warmup_grows_the_window_linearly_to_its_full_length():
    assert ema_decay_at(0, 0.999, 100) == 0.0  # window of 1 step: the EMA copies the weights
    assert ema_decay_at(50, 0.999, 100) == pytest.approx(1 - 1 / (1 + 999 * 0.5))
    assert ema_decay_at(100, 0.999, 100) == pytest.approx(0.999)
    assert ema_decay_at(10_000, 0.999, 100) == pytest.approx(0.999)
    assert ema_decay_at(0, 0.9999, 0) == 0.9999  # no warmup


def test_update_is_an_exponential_moving_average():
    model = torch.nn.Linear(2, 1)
    ema = make_ema(model)
    with torch.no_grad():
        model.weight.fill_(1.0)
        ema.weight.fill_(0.0)
    update = EmaUpdater(ema, model)
    update(0.9)
    assert torch.allclose(ema.weight, torch.full_like(ema.weight, 0.1))
    update(0.9)
    assert torch.allclose(ema.weight, torch.full_like(ema.weight, 0.19))
    assert not ema.weight.requires_grad and not ema.training
