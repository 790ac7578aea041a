"""Per-sample diffusion inputs (timestep and Gaussian noise) as pure functions of (seed, stream position).

Training draws them from a generator keyed by (seed, position // NOISE_BLOCK): one vectorized draw per block of
positions. A sample therefore gets the same noise whatever the world size, micro-batch size or restart history.
On a CPU the loader thread draws them ahead of the step; on a CUDA GPU the step draws them with a generator of
the GPU's own, where they are used. Why: on the host, the draw (the largest part of the loader thread's work)
competes with the training thread, whose host time per step is what keeps a GPU busy, and the noise would be
copied to the GPU every step. So a sample's noise is the same on every CPU, and the same on every GPU with as many
multiprocessors, but not the same on a CPU and a GPU: torch spreads a draw of more values than the GPU runs threads
at once (16 positions of 3x75x75 on a 132-multiprocessor H100 or H200) over a grid the size of the GPU, so another
model of GPU, or a MIG slice of one, draws other noise for large images (on a small slice, for small ones too). The
small, fixed validation set uses a numpy Philox stream per position instead, identical on every device.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from raydiff.seeds import derive_seed

NOISE_BLOCK = 16  # positions per noise draw: vectorized, with little waste at uneven share boundaries
_NOISE_TAG = 0x6E6F697365  # keeps the noise streams apart from the dropout seeds (seed, position)
_LABEL_DROP_TAG = 0x6C61626C  # and from the label dropout draws

_local = threading.local()  # generators per thread: the loader thread draws ahead of the training thread


def _thread_generator(device: torch.device | None = None) -> torch.Generator:
    """This thread's generator on `device` (the CPU by default), reseeded for every block it draws."""
    if not hasattr(_local, "generators"):
        _local.generators = {}
    key = "cpu" if device is None else str(device)
    if key not in _local.generators:
        _local.generators[key] = torch.Generator() if device is None else torch.Generator(device=device)
    return _local.generators[key]


def drawn_on_device(device: torch.device) -> bool:
    """Whether training on `device` draws its timesteps and noise there (a CUDA GPU), not on the host."""
    return device.type == "cuda"


def position_noise(seed: int, start: int, count: int, *, timesteps: int, shape: tuple[int, ...],
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Timesteps (count,) and Gaussian noise (count, *shape) of stream positions [start, start + count) on
    `device`: a pure function of (seed, position) and the kind of device. Drawn on a CUDA GPU by its own generator
    (the step's, at no host cost); else on the CPU and moved to `device` (the loader thread draws them ahead of
    time: `BatchStream`)."""
    device = torch.device(device)
    generator = _thread_generator(device if drawn_on_device(device) else None)
    t_parts, noise_parts = [], []
    for block in range(start // NOISE_BLOCK, (start + count - 1) // NOISE_BLOCK + 1):
        generator.manual_seed(derive_seed(seed, _NOISE_TAG, block))
        block_t = torch.randint(timesteps, (NOISE_BLOCK,), generator=generator, device=generator.device)
        block_noise = torch.randn((NOISE_BLOCK, *shape), generator=generator, device=generator.device)
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
