"""Worker-side batches: gather this worker's samples of each step from the shared uint8 chunks, ahead of time.

A background thread turns stream positions (see `raydiff.data.order`) into uint8 micro-batches in host memory
(pinned when training on a GPU) a few steps ahead, so the training loop never waits for data; its work is
vectorized (one gather per chunk), never per image. The cheap per-epoch work, scaling to [-1, 1] and
horizontal flips, is done on the training device.

Each sample's diffusion timestep and noise are a pure function of (seed, stream position) (see
`raydiff.data.noise`), so runs with 1 or 8 workers, with or without accumulation, compute the same updates. So is
a class-conditional run's label dropout: a sample's class id comes from its index, and whether it trains as the
null class from (seed, position).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from raydiff.data.noise import drawn_on_device, dropped_labels, position_noise
from raydiff.data.order import SampleOrder, Share, micro_batches


class ImageTable:
    """Random access by sample index over a list of uint8 (n_i, C, H, W) chunks; `labels`: the int32 class id of
    every sample index (labelled data), else None."""

    def __init__(self, chunks: list[np.ndarray], labels: np.ndarray | None = None) -> None:
        self.chunks = chunks
        self.starts = np.cumsum([0] + [len(c) for c in chunks])
        self.shape = chunks[0].shape[1:]
        self.labels = labels

    def __len__(self) -> int:
        return int(self.starts[-1])

    def prepare(self, position: int) -> None:
        """Nothing to read ahead: every chunk is in memory (see `raydiff.data.node_cache.StreamTable`)."""

    def gather(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        chunk_of = np.searchsorted(self.starts, indices, side="right") - 1
        for c in np.unique(chunk_of):
            selected = chunk_of == c
            out[selected] = self.chunks[c][indices[selected] - self.starts[c]]
        return out


class Table(Protocol):
    """What `BatchStream` gathers samples from: an `ImageTable`, or a `raydiff.data.node_cache.StreamTable`."""

    @property
    def shape(self) -> tuple[int, ...]: ...  # of one image: (C, H, W)

    @property
    def labels(self) -> np.ndarray | None: ...  # class id of every sample index, or None

    def __len__(self) -> int: ...

    def prepare(self, position: int) -> None: ...

    def gather(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray: ...


@dataclass
class MicroBatch:
    images: torch.Tensor  # uint8 (n, C, H, W), on the host (on the device where gathered there: data.on_device)
    flips: torch.Tensor  # bool (n,)
    position: int  # stream position of the first sample
    indices: np.ndarray  # dataset indices of the samples (for the order audit)
    timesteps: torch.Tensor | None = None  # diffusion timesteps and noise, on the host, once drawn
    noise: torch.Tensor | None = None
    labels: torch.Tensor | None = None  # class-conditional: int64 (n,) class ids, the null id where dropped

    def __len__(self) -> int:
        return len(self.images)

    def to_device(self, device: torch.device, flip: bool) -> torch.Tensor:
        """Float images in [-1, 1] on `device`, horizontally flipped where the flip bit is set."""
        return scaled(self.images.to(device, non_blocking=True), self.flips.to(device, non_blocking=True), flip)

    def diffusion_inputs(self, seed: int, timesteps: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's diffusion timesteps and noise on `device` (see `position_noise`): on a CUDA GPU drawn
        now, by the GPU; else drawn ahead by the loader thread when it knew the seed, or now."""
        if drawn_on_device(device):
            return position_noise(seed, self.position, len(self), timesteps=timesteps,
                                  shape=tuple(self.images.shape[1:]), device=device)
        if self.noise is None:
            self.timesteps, self.noise = position_noise(seed, self.position, len(self), timesteps=timesteps,
                                                        shape=tuple(self.images.shape[1:]))
        assert self.timesteps is not None  # drawn with the noise
        return self.timesteps.to(device, non_blocking=True), self.noise.to(device, non_blocking=True)

    def label_inputs(self, device: torch.device) -> torch.Tensor | None:
        """This micro-batch's class ids on `device` (after label dropout), or None for unconditional training."""
        return None if self.labels is None else self.labels.to(device, non_blocking=True)


def scaled(images: torch.Tensor, flips: torch.Tensor, flip: bool) -> torch.Tensor:
    """uint8 images (n, C, H, W) as floats in [-1, 1], horizontally flipped where `flip` is on and the sample's
    flip bit is set; on the images' device (the training step compiles it into its forward pass)."""
    x = images.float() / 127.5 - 1.0
    return torch.where(flips[:, None, None, None], x.flip(-1), x) if flip else x


def class_ids(table_labels: np.ndarray, indices: np.ndarray, position: int, *, seed: int,
              labels: tuple[float, int]) -> torch.Tensor:
    """int64 class ids (on the host) of the samples `indices` at stream positions [position, ...), the null id where
    label dropout (`labels` = (train.label_dropout, null class id), keyed by `seed`) drops them."""
    probability, null = labels
    ids = torch.from_numpy(table_labels[indices].astype(np.int64))
    if (ids < 0).any():  # bad samples are never in the order: a table that does not match it
        raise ValueError(f"samples without a label in the training stream: {indices[(ids < 0).numpy()][:5]}")
    ids[dropped_labels(seed, position, len(indices), probability)] = null
    return ids


class Batches(Protocol):
    """This worker's micro-batches of every optimizer step in turn: a `BatchStream`, or a
    `raydiff.data.on_device.DeviceBatchStream`."""

    def __iter__(self) -> Iterator[list[MicroBatch]]: ...

    def __next__(self) -> list[MicroBatch]: ...

    def close(self) -> None: ...


class BatchStream:
    """Yields, for every optimizer step from `start_step` on, this worker's micro-batches.

    :param table: the decoded images (an `ImageTable`, or a `StreamTable` for streamed data).
    :param order: the global sample stream.
    :param global_batch: samples per optimizer step over all workers.
    :param share: this worker's slice of every global batch.
    :param micro_batch: samples per forward pass on this worker.
    :param start_step: the first optimizer step to produce (resume point).
    :param pin_memory: pin host buffers for asynchronous copies to a GPU.
    :param prefetch_steps: how many steps the background thread may run ahead.
    :param noise: (seed, T): also draw each micro-batch's diffusion timesteps and noise ahead, in the thread.
    :param device_noise: the training device draws the timesteps and noise itself (`drawn_on_device`,
        `MicroBatch.diffusion_inputs`): the thread draws neither.
    :param labels: (train.label_dropout, null class id): class-conditional training; each micro-batch gets its
        samples' class ids (`MicroBatch.labels`), the null id where `dropped_labels` (keyed by the seed of
        `noise`, which it needs) says so.
    """

    def __init__(
        self, *, table: Table, order: SampleOrder, global_batch: int, share: Share, micro_batch: int,
        start_step: int, pin_memory: bool, prefetch_steps: int = 4, noise: tuple[int, int] | None = None,
        device_noise: bool = False, labels: tuple[float, int] | None = None,
    ) -> None:
        if labels is not None and (noise is None or table.labels is None):
            raise ValueError("BatchStream(labels=...) needs noise=(seed, T) and a table with labels")
        self._table, self._order, self._noise, self._labels = table, order, noise, labels
        self._device_noise = device_noise
        self._global_batch, self._pin = global_batch, pin_memory
        self._layout = micro_batches(share, micro_batch)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch_steps)
        self._stop = threading.Event()
        # The thread's CPU seconds making the steps it has produced (not waiting for room): what it takes from the
        # host beside the training thread (`raydiff.bench step`).
        self.produced_steps, self.cpu_s = 0, 0.0
        self._thread = threading.Thread(target=self._produce, args=(start_step,), daemon=True, name="raydiff-loader")
        self._thread.start()

    def _step_batches(self, step: int) -> list[MicroBatch]:
        batches = []
        self._table.prepare(step * self._global_batch)
        for offset, size in self._layout:
            if self._stop.is_set():  # closed: no more reads for a step no one will take (a rollback's successor
                break                # may be reading the same table)
            position = step * self._global_batch + offset
            indices, flip_bits = self._order.take(position, size)
            images = torch.empty((size, *self._table.shape), dtype=torch.uint8, pin_memory=self._pin)
            self._table.gather(indices, images.numpy())
            flips = torch.from_numpy(flip_bits)
            batch = MicroBatch(images=images, flips=flips.pin_memory() if self._pin else flips, position=position,
                               indices=indices)
            if self._noise is not None and not self._device_noise:
                seed, timesteps = self._noise
                t, noise = position_noise(seed, position, size, timesteps=timesteps, shape=tuple(self._table.shape))
                batch.timesteps, batch.noise = (t.pin_memory(), noise.pin_memory()) if self._pin else (t, noise)
            if self._labels is not None:
                assert self._noise is not None and self._table.labels is not None  # checked at construction
                ids = class_ids(self._table.labels, indices, position, seed=self._noise[0], labels=self._labels)
                batch.labels = ids.pin_memory() if self._pin else ids
            batches.append(batch)
        return batches

    def _produce(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                cpu_start = time.thread_time()
                item = self._step_batches(step)
                self.produced_steps, self.cpu_s = self.produced_steps + 1, self.cpu_s + time.thread_time() - cpu_start
                self._put(item)
                step += 1
        except BaseException as exc:  # surface loader errors in the training loop, not in a dead thread
            self._put(exc)

    def _put(self, item: list[MicroBatch] | BaseException) -> None:
        """Queue `item` once there is room, or give up at close: a full queue no one reads any more must not hold
        the thread (and its pinned buffers) for ever."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> list[MicroBatch]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
