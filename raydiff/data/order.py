"""The order in which training sees samples: one global stream, the same on every worker and every run.

Epoch e visits all N samples in `permutation(seed, e)`; stream position p is sample p mod N of epoch p // N.
Optimizer step s consumes stream positions [s * global_batch, (s + 1) * global_batch), and each worker takes
a fixed slice of that range. So the samples of a step depend only on (seed, step), never on the world size,
and resuming at step s (mid-epoch or not) continues the stream exactly where it stopped (EDM2 does the same).

Streamed data (`data.cache=stream`) uses a shard-aware permutation instead, as Mosaic Streaming does: each
epoch shuffles the shard order, cuts it into windows of `window_shards` shards, and shuffles the samples within
each window. A worker then needs one window of shards at a time, read sequentially, and every sample still
appears once per epoch; the price is that a batch mixes `window_shards` shards rather than the whole dataset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raydiff.seeds import keyed_rng


class SampleOrder:
    """Maps stream positions to sample indices and per-sample flip bits.

    :param samples: the dataset indices to train on (all but the held-out ones), or their count N for 0..N-1.
    :param seed: the run's seed; with the epoch it fixes the permutation and the flips.
    :param shard_starts: streamed data: the first sample index of every shard, plus the total (a shard-aware
        permutation, see the module docstring); None: a uniform permutation of all samples.
    :param window_shards: streamed data: shards shuffled together.
    """

    _PERMUTATION, _FLIP, _SHARDS, _WINDOW = 0, 1, 2, 3  # independent random streams per epoch

    def __init__(self, samples: int | np.ndarray, seed: int, *, shard_starts: np.ndarray | None = None,
                 window_shards: int = 1) -> None:
        self._indices = np.arange(samples) if isinstance(samples, (int, np.integer)) else np.asarray(samples)
        if len(self._indices) < 1:
            raise ValueError("need at least one sample to train on")
        self.num_samples = len(self._indices)
        self.seed = seed
        self._shard_of = None if shard_starts is None else np.searchsorted(shard_starts, self._indices, "right") - 1
        self.num_shards = 0 if shard_starts is None else len(shard_starts) - 1
        self.window_shards = window_shards
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # the last two epochs used
        self._window_cache: tuple[tuple[int, int], list[int]] | None = None

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(permutation, flips, window ends) of an epoch; window ends only for streamed data."""
        if epoch not in self._epochs:
            if self._shard_of is None:
                permutation = keyed_rng(self.seed, epoch, self._PERMUTATION).permutation(self.num_samples)
                window_ends = np.empty(0, np.int64)
            else:
                permutation, window_ends = self._shard_aware(epoch)
            flips = keyed_rng(self.seed, epoch, self._FLIP).random(self.num_samples) < 0.5
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = (permutation, flips, window_ends)
        return self._epochs[epoch]

    def _shard_aware(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's permutation (windows of shuffled shards, samples shuffled within each window), and the
        stream offset at which each window ends."""
        shard_rank = np.empty(self.num_shards, np.int64)
        shard_rank[keyed_rng(self.seed, epoch, self._SHARDS).permutation(self.num_shards)] = np.arange(self.num_shards)
        window = shard_rank[self._shard_of] // self.window_shards
        within = keyed_rng(self.seed, epoch, self._WINDOW).random(self.num_samples)
        permutation = np.lexsort((within, window))
        return permutation, np.cumsum(np.bincount(window))

    def window_shards_at(self, position: int) -> tuple[tuple[int, int], list[int]]:
        """Streamed data: ((epoch, window), the window's shards) of stream position `position`."""
        epoch, offset = divmod(position, self.num_samples)
        permutation, _, window_ends = self._epoch(epoch)
        window = int(np.searchsorted(window_ends, offset, "right"))
        if self._window_cache is None or self._window_cache[0] != (epoch, window):
            start = 0 if window == 0 else int(window_ends[window - 1])
            members = permutation[start:int(window_ends[window])]
            assert self._shard_of is not None  # streamed data: otherwise window_ends is empty and the line above raised
            self._window_cache = ((epoch, window), np.unique(self._shard_of[members]).tolist())
        return self._window_cache

    def next_window(self, key: tuple[int, int]) -> int:
        """The stream position where the window after `key` = (epoch, window) begins."""
        epoch, window = key
        window_ends = self._epoch(epoch)[2]
        return epoch * self.num_samples + int(window_ends[min(window, len(window_ends) - 1)])

    def take(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample indices and flip bits of stream positions [start, start + count)."""
        indices, flips = np.empty(count, np.int64), np.empty(count, bool)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, self.num_samples)
            n = min(count - done, self.num_samples - offset)
            permutation, epoch_flips, _ = self._epoch(epoch)
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
