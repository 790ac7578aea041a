"""Held-out validation: a fixed split of the dataset, and a loss with fixed timesteps and fixed noise.

The training loss is noisy (every step draws new timesteps and noise), too noisy to compare runs or to stop
trials early. The validation loss evaluates the same held-out images at the same timesteps with the same
noise every time, so two evaluations differ only through the weights. Each held-out image is evaluated at
`TIMESTEPS_PER_IMAGE` timesteps, one in each quarter of [0, T), all images together covering [0, T) evenly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from raydiff.data.errors import DataError
from raydiff.data.loader import ImageTable
from raydiff.data.noise import sample_noise
from raydiff.model.diffusion import full_fp32
from raydiff.seeds import keyed_rng

TIMESTEPS_PER_IMAGE = 4
_HOLDOUT_TAG = 0x686F6C64  # (seed, tag, 1): apart from the per-epoch (seed, epoch, 0|1) streams
_NOISE_POSITIONS = 1 << 62  # noise keys for validation items start here, far beyond any training position


def check_holdout(val_images: int, usable: int) -> None:
    """`data.val_images` against the usable images of data.source: a DataError (one line) where it leaves none to
    train on."""
    if val_images >= usable:
        raise DataError(f"data.val_images = {val_images}: must be below the number of usable images in data.source "
                        f"({usable})")


def holdout_split(samples: int | np.ndarray, val_images: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices), both sorted: a pure function of (samples, val_images, seed).

    :param samples: the usable sample indices (bad samples left out), or their count N for 0..N-1.
    """
    indices = np.arange(samples) if isinstance(samples, (int, np.integer)) else np.asarray(samples)
    if not 0 <= val_images < len(indices):
        raise ValueError(f"val_images must be in [0, {len(indices)}), got {val_images}")
    if val_images == 0:
        return indices, np.empty(0, np.int64)
    permutation = indices[keyed_rng(seed, _HOLDOUT_TAG, 1).permutation(len(indices))]
    return np.sort(permutation[val_images:]), np.sort(permutation[:val_images])


def validation_timesteps(num_val: int, timesteps: int) -> np.ndarray:
    """(num_val, TIMESTEPS_PER_IMAGE) timesteps: image j gets one in each quarter of [0, T), stratified."""
    k, j = np.meshgrid(np.arange(TIMESTEPS_PER_IMAGE), np.arange(num_val))
    items = num_val * TIMESTEPS_PER_IMAGE
    return ((k * num_val + j + 0.5) * timesteps / items).astype(np.int64)


class Validation:
    """This worker's part of the validation items (image, timestep pairs), and the distributed loss over all.

    :param table: the decoded images.
    :param val_indices: the held-out image indices (the same on every worker).
    :param seed: the run's seed, which keys the noise.
    :param timesteps: the diffusion's T.
    :param rank, world_size: this worker's place; items are split as evenly as possible.
    :param labels: class-conditional runs: the class of each held-out image (aligned with `val_indices`); the
        loss is the conditional one (no label dropout).
    """

    def __init__(self, *, table: ImageTable, val_indices: np.ndarray, seed: int, timesteps: int, rank: int,
                 world_size: int, labels: np.ndarray | None = None) -> None:
        items = len(val_indices) * TIMESTEPS_PER_IMAGE
        base, extra = divmod(items, world_size)
        start = rank * base + min(rank, extra)
        self._items = np.arange(start, start + base + (rank < extra))  # item = image * K + timestep slot
        self._table, self._val_indices, self._seed = table, val_indices, seed
        self._labels = None if labels is None else torch.from_numpy(np.asarray(labels, np.int64))
        self._timesteps = validation_timesteps(len(val_indices), timesteps).reshape(-1)
        self.num_items = items

    @torch.no_grad()
    def loss(self, model: torch.nn.Module, diffusion, device: torch.device, batch: int = 256) -> float:
        """Mean validation loss over all workers' items (every worker must call it), fp32, eval mode."""
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        shape = tuple(self._table.shape)
        with full_fp32():  # TF32 off, as sampling runs: validation losses are fp32 on every device
            for start in range(0, len(self._items), batch):
                items = self._items[start:start + batch]
                images = self._table.gather(self._val_indices[items // TIMESTEPS_PER_IMAGE],
                                            np.empty((len(items), *shape), np.uint8))
                noise = np.empty((len(items), *shape), np.float32)
                sample_noise(self._seed, _NOISE_POSITIONS + items, 1, shape, noise)
                x0 = torch.from_numpy(images).to(device).float().div_(127.5).sub_(1.0)
                t = torch.from_numpy(self._timesteps[items]).to(device)
                labels = None if self._labels is None else self._labels[items // TIMESTEPS_PER_IMAGE].to(device)
                losses = diffusion.loss_per_sample(model, x0, t, torch.from_numpy(noise).to(device), labels)
                total += torch.stack([losses.double().sum(), torch.tensor(float(len(items)), device=device,
                                                                          dtype=torch.float64)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        model.train(was_training)
        return float(total[0] / total[1])
