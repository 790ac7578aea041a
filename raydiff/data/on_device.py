"""Micro-batches gathered on the training device from a copy of the images kept there (`data.on_device`).

Why: on a GPU the training thread's host time per step is what keeps the GPU fed, and the loader thread
(`raydiff.data.loader.BatchStream`), gathering each step's images on the host and copying them over, competes with
it for the interpreter and for CUDA's host calls (docs/benchmarks.md#gpu-throughput). A dataset held in memory that
is small beside the GPU (CIFAR-10's 50,000 images are 154 MB) can live on the GPU instead: each micro-batch is then
one copy of its sample indices and flip bits (and class ids), a few kilobytes, and one gather on the device, issued
by the training thread itself, with no thread beside it. The samples, flips, class ids and noise of every stream
position are those `BatchStream` gives, so both train alike, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from raydiff.data.loader import Batches, BatchStream, ImageTable, MicroBatch, class_ids
from raydiff.data.node_cache import StreamTable
from raydiff.data.noise import drawn_on_device
from raydiff.data.order import SampleOrder, Share, micro_batches

DEVICE_SHARE = 1 / 8  # `auto` keeps the images on a GPU when they take at most this share of its memory
COPY_BYTES = 64 << 20  # the chunks reach the device in pieces of about this size (each piece a host copy first)


class DeviceImages:
    """Every image of an in-memory `ImageTable`, by sample index, in one uint8 tensor on `device`; the class ids
    stay on the host, where label dropout is drawn."""

    def __init__(self, table: ImageTable, device: torch.device) -> None:
        self.labels, self.device = table.labels, device
        self.images = torch.empty((len(table), *table.shape), dtype=torch.uint8, device=device)
        rows = max(1, COPY_BYTES // max(1, int(np.prod(table.shape))))
        for chunk, start in zip(table.chunks, table.starts[:-1], strict=True):
            for i in range(0, len(chunk), rows):
                # A writable copy: the chunks are the object store's read-only memory, which torch will not wrap.
                piece = torch.from_numpy(np.array(chunk[i:i + rows]))
                self.images[start + i:start + i + len(piece)].copy_(piece)

    @property
    def nbytes(self) -> int:
        return self.images.numel()


def place_images(option: bool | str, table: ImageTable | StreamTable,
                 device: torch.device) -> tuple[DeviceImages | None, str]:
    """`data.on_device` made concrete for this worker: the images copied to `device` (or None: the loader thread
    gathers them on the host), and a phrase for the start line saying which and, for `auto`, why."""
    if option is False:
        return None, "data on the host"
    if isinstance(table, StreamTable):
        if option is True:  # the driver refuses this before training starts
            raise ValueError("data.on_device = true: needs the images in memory (data.cache memory), not streamed")
        return None, "data on the host (data.on_device auto: streamed)"
    if option == "auto":
        size = sum(chunk.nbytes for chunk in table.chunks)
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        if device.type != "cuda" or size > DEVICE_SHARE * total:
            why = ("not CUDA" if device.type != "cuda"
                   else f"{size / 1e9:.2f} GB is over {DEVICE_SHARE:.3g} of the GPU's {total / 1e9:.0f} GB")
            return None, f"data on the host (data.on_device auto: {why})"
    images = DeviceImages(table, device)
    return images, f"data on the {'GPU' if device.type == 'cuda' else device.type} ({images.nbytes / 1e6:.1f} MB)"


class DeviceBatchStream:
    """Yields, for every optimizer step from `start_step` on, this worker's micro-batches, gathered on the images'
    device when asked for (`BatchStream`'s parameters, less those of its thread).

    :param images: the images on the training device.
    :param order: the global sample stream.
    :param global_batch: samples per optimizer step over all workers.
    :param share: this worker's slice of every global batch.
    :param micro_batch: samples per forward pass on this worker.
    :param start_step: the first optimizer step to produce (resume point).
    :param seed: keys label dropout (as `BatchStream`'s `noise` seed does).
    :param labels: (train.label_dropout, null class id): class-conditional training.
    """

    def __init__(self, *, images: DeviceImages, order: SampleOrder, global_batch: int, share: Share,
                 micro_batch: int, start_step: int, seed: int, labels: tuple[float, int] | None = None) -> None:
        if labels is not None and images.labels is None:
            raise ValueError("DeviceBatchStream(labels=...) needs images with labels")
        self._images, self._order, self._global_batch = images, order, global_batch
        self._layout = micro_batches(share, micro_batch)
        self._step, self._seed, self._labels = start_step, seed, labels
        self._pin = images.device.type == "cuda"

    def __iter__(self) -> DeviceBatchStream:
        return self

    def __next__(self) -> list[MicroBatch]:
        batches = []
        for offset, size in self._layout:
            position = self._step * self._global_batch + offset
            indices, flip_bits = self._order.take(position, size)
            rows = [indices, flip_bits.astype(np.int64)]
            if self._labels is not None:
                assert self._images.labels is not None  # checked at construction
                rows.append(class_ids(self._images.labels, indices, position, seed=self._seed,
                                      labels=self._labels).numpy())
            # One copy to the device per micro-batch: its indices, flip bits and class ids, one row each.
            packed = torch.from_numpy(np.stack(rows))
            packed = (packed.pin_memory() if self._pin else packed).to(self._images.device, non_blocking=True)
            batches.append(MicroBatch(images=self._images.images.index_select(0, packed[0]), flips=packed[1].bool(),
                                      position=position, indices=indices,
                                      labels=packed[2] if self._labels is not None else None))
        self._step += 1
        return batches

    def close(self) -> None:
        """Nothing runs beside the training thread."""


def open_batches(*, table: ImageTable | StreamTable, images: DeviceImages | None, order: SampleOrder,
                 global_batch: int, share: Share, micro_batch: int, start_step: int, seed: int, timesteps: int,
                 device: torch.device, labels: tuple[float, int] | None = None) -> Batches:
    """A worker's micro-batches from `start_step` on: gathered on the device from `images` where `place_images`
    put them there, else by the loader thread from `table` (with each position's noise, drawn on `device` where
    that is a GPU). `seed` keys the noise and label dropout alike on both paths."""
    if images is not None:
        return DeviceBatchStream(images=images, order=order, global_batch=global_batch, share=share,
                                 micro_batch=micro_batch, start_step=start_step, seed=seed, labels=labels)
    return BatchStream(table=table, order=order, global_batch=global_batch, share=share, micro_batch=micro_batch,
                       start_step=start_step, pin_memory=device.type == "cuda", noise=(seed, timesteps),
                       device_noise=drawn_on_device(device), labels=labels)
