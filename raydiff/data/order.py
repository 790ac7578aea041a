"""The order in which training sees samples: one global stream, the same on every worker and every run.

Epoch e visits all N samples in `permutation(seed, e)`; stream position p is sample p mod N of epoch p // N.
Optimizer step s consumes stream positions [s * global_batch, (s + 1) * global_batch), and each worker takes
a fixed slice of that range. So the samples of a step depend only on (seed, step), never on the world size,
and resuming at step s (mid-epoch or not) continues the stream exactly where it stopped (EDM2 does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def keyed_rng(*key: int) -> np.random.Generator:
    """A random generator that is a pure function of the key. Trailing zeros do not count: (s, e) and
    (s, e, 0) are the same key, so give each stream a distinct non-zero tag."""
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def derive_seed(*key: int) -> int:
    """A 63-bit seed that is a pure function of the key, for torch generators."""
    return int(np.random.SeedSequence(list(key)).generate_state(2, np.uint64)[0] >> np.uint64(1))


class SampleOrder:
    """Maps stream positions to sample indices and per-sample flip bits.

    :param samples: the dataset indices to train on (all but the held-out ones), or their count N for 0..N-1.
    :param seed: the run's seed; with the epoch it fixes the permutation and the flips.
    """

    _PERMUTATION, _FLIP = 0, 1  # independent random streams per epoch

    def __init__(self, samples: int | np.ndarray, seed: int) -> None:
        self._indices = np.arange(samples) if isinstance(samples, (int, np.integer)) else np.asarray(samples)
        if len(self._indices) < 1:
            raise ValueError("need at least one sample to train on")
        self.num_samples = len(self._indices)
        self.seed = seed
        self._cached_epoch = -1
        self._permutation = self._flips = np.empty(0)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch != self._cached_epoch:
            self._permutation = keyed_rng(self.seed, epoch, self._PERMUTATION).permutation(self.num_samples)
            self._flips = keyed_rng(self.seed, epoch, self._FLIP).random(self.num_samples) < 0.5
            self._cached_epoch = epoch
        return self._permutation, self._flips

    def take(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample indices and flip bits of stream positions [start, start + count)."""
        indices, flips = np.empty(count, np.int64), np.empty(count, bool)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, self.num_samples)
            n = min(count - done, self.num_samples - offset)
            permutation, epoch_flips = self._epoch(epoch)
            indices[done:done + n] = self._indices[permutation[offset:offset + n]]
            flips[done:done + n] = epoch_flips[permutation[offset:offset + n]]
            done += n
        return indices, flips


@dataclass(frozen=True)
class Share:
    """One worker's part of every global batch: positions [offset, offset + size) within it."""

    offset: int
    size: int


def rank_share(global_batch: int, world_size: int, rank: int) -> Share:
    """Split the global batch over the workers as evenly as possible (the first global_batch % world_size
    workers get one more), so every world size up to global_batch reaches the global batch exactly."""
    if not 0 <= rank < world_size <= global_batch:
        raise ValueError(f"need 0 <= rank < world_size <= global_batch, got {rank}, {world_size}, {global_batch}")
    base, extra = divmod(global_batch, world_size)
    return Share(offset=rank * base + min(rank, extra), size=base + (rank < extra))


def micro_batches(share: Share, micro_batch: int) -> list[tuple[int, int]]:
    """(offset, size) of each micro-batch of a share; the last one may be smaller."""
    return [(share.offset + i, min(micro_batch, share.size - i)) for i in range(0, share.size, micro_batch)]
