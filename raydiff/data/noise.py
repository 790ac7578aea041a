"""Per-sample diffusion inputs (timestep and Gaussian noise) as pure functions of (seed, stream position).

Training draws them on the CPU from a generator keyed by (seed, position // NOISE_BLOCK): one vectorized draw
per block of positions, done by the loader thread ahead of the step. A sample therefore gets the same noise
whatever the world size, micro-batch size, restart history or device. The small, fixed validation set uses a
numpy Philox stream per position instead, identical on every device.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from raydiff.seeds import derive_seed

NOISE_BLOCK = 16  # positions per noise draw: vectorized, with little waste at uneven share boundaries
_NOISE_TAG = 0x6E6F697365  # keeps the noise streams apart from the dropout seeds (seed, position)
_LABEL_DROP_TAG = 0x6C61626C  # and from the label dropout draws

_local = threading.local()  # one CPU generator per thread: the loader thread draws ahead of the training thread


def _thread_generator() -> torch.Generator:
    """This thread's CPU generator (reseeded for every block it draws)."""
    if not hasattr(_local, "generator"):
        _local.generator = torch.Generator()
    return _local.generator


def position_noise(seed: int, start: int, count: int, *, timesteps: int, shape: tuple[int, ...],
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Timesteps (count,) and Gaussian noise (count, *shape) of stream positions [start, start + count): a pure
    function of (seed, position), drawn on the CPU (so the same on every device) and moved to `device`. The
    loader thread draws them ahead of time (`BatchStream`), off the training step's path."""
    generator = _thread_generator()
    t_parts, noise_parts = [], []
    for block in range(start // NOISE_BLOCK, (start + count - 1) // NOISE_BLOCK + 1):
        generator.manual_seed(derive_seed(seed, _NOISE_TAG, block))
        block_t = torch.randint(timesteps, (NOISE_BLOCK,), generator=generator)
        block_noise = torch.randn((NOISE_BLOCK, *shape), generator=generator)
        low, high = max(start, block * NOISE_BLOCK), min(start + count, (block + 1) * NOISE_BLOCK)
        t_parts.append(block_t[low - block * NOISE_BLOCK:high - block * NOISE_BLOCK])
        noise_parts.append(block_noise[low - block * NOISE_BLOCK:high - block * NOISE_BLOCK])
    return torch.cat(t_parts).to(device), torch.cat(noise_parts).to(device)


def dropped_labels(seed: int, start: int, count: int, probability: float) -> torch.Tensor:
    """bool (count,): which samples of stream positions [start, start + count) train with the null class
    (`train.label_dropout`), a pure function of (seed, position) like the noise: one uniform draw per position,
    by blocks of NOISE_BLOCK, on the CPU."""
    if probability <= 0:
        return torch.zeros(count, dtype=torch.bool)
    generator = _thread_generator()
    parts = []
    for block in range(start // NOISE_BLOCK, (start + count - 1) // NOISE_BLOCK + 1):
        generator.manual_seed(derive_seed(seed, _LABEL_DROP_TAG, block))
        draws = torch.rand(NOISE_BLOCK, generator=generator)
        low, high = max(start, block * NOISE_BLOCK), min(start + count, (block + 1) * NOISE_BLOCK)
        parts.append(draws[low - block * NOISE_BLOCK:high - block * NOISE_BLOCK])
    return torch.cat(parts) < probability


def sample_noise(seed: int, positions: np.ndarray, timesteps: int, shape: tuple[int, ...],
                 noise_out: np.ndarray) -> np.ndarray:
    """Per-sample timestep and Gaussian noise from numpy, a pure function of (seed, position) on any device:
    for the small, fixed validation set (training uses `position_noise`)."""
    t = np.empty(len(positions), np.int64)
    for i, position in enumerate(positions):
        rng = np.random.Generator(np.random.Philox(key=(seed << 64) | int(position)))
        t[i] = rng.integers(timesteps)
        rng.standard_normal(shape, dtype=np.float32, out=noise_out[i])
    return t
