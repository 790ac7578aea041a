"""Per-position diffusion noise: a pure function of (seed, position)."""

from __future__ import annotations

import numpy as np
import torch

from raydiff.data.noise import position_noise, sample_noise


def test_position_noise_is_a_function_of_position_whatever_the_split():
    cpu = torch.device("cpu")
    t_all, noise_all = position_noise(3, 30, 40, timesteps=1000, shape=(1, 4, 4), device=cpu)
    for start, count in ((30, 1), (37, 5), (45, 25), (64, 6)):  # inside, across and at block boundaries
        t, noise = position_noise(3, start, count, timesteps=1000, shape=(1, 4, 4), device=cpu)
        part = slice(start - 30, start - 30 + count)
        assert torch.equal(noise, noise_all[part]) and torch.equal(t, t_all[part])
    assert abs(noise_all.mean()) < 0.2 and abs(noise_all.std() - 1) < 0.1 and 0 <= t_all.min() and t_all.max() < 1000
    other_seed = position_noise(4, 30, 40, timesteps=1000, shape=(1, 4, 4), device=cpu)[1]
    assert not torch.equal(other_seed, noise_all)


def test_noise_is_standard_normal_and_keyed_by_position():
    out = np.empty((200, 1, 8, 8), np.float32)
    t = sample_noise(0, np.arange(200), 1000, (1, 8, 8), out)
    assert abs(out.mean()) < 0.05 and abs(out.std() - 1) < 0.05 and 0 <= t.min() and t.max() < 1000
    again = np.empty((1, 1, 8, 8), np.float32)
    sample_noise(0, np.array([17]), 1000, (1, 8, 8), again)
    assert np.array_equal(again[0], out[17])
