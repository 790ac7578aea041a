"""Micro-batches gathered on the training device (`data.on_device`): the loader thread's samples, flips and class
ids at every stream position, and the same training, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydiff.config import load_config
from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.on_device import DeviceBatchStream, DeviceImages, place_images
from raydiff.data.order import SampleOrder, rank_share
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import EmaUpdater, make_ema
from raydiff.training.step import StepParts, make_optimizer, optimizer_step

CPU = torch.device("cpu")


def _table(n: int = 23, chunk: int = 5, shape=(1, 8, 8), classes: int = 3) -> tuple[np.ndarray, ImageTable]:
    images = np.random.default_rng(0).integers(0, 256, (n, *shape), dtype=np.uint8)
    labels = (np.arange(n) % classes).astype(np.int32)
    chunks = [images[i:i + chunk] for i in range(0, n, chunk)]
    for c in chunks:
        c.flags.writeable = False  # as the object store's shared memory is
    return images, ImageTable(chunks, labels=labels)


@pytest.mark.parametrize("world", [1, 3])
def test_batches_gathered_on_the_device_are_the_loader_threads_at_every_position(world):
    """Every worker's micro-batches of a resumed stream, with label dropout: images, flips, class ids, positions
    and indices as the loader thread gives them, for uneven shares and a last micro-batch smaller than the others;
    over an epoch's end."""
    _, table = _table()
    order = SampleOrder(np.arange(2, 23), seed=5)  # two samples held out
    labels = (0.5, 3)  # label dropout half the time; the null class is 3
    images = DeviceImages(table, CPU)
    dropped = 0
    for rank in range(world):
        share = rank_share(8, world, rank)
        thread = BatchStream(table=table, order=order, global_batch=8, share=share, micro_batch=2, start_step=1,
                             pin_memory=False, noise=(7, 100), labels=labels)
        device = DeviceBatchStream(images=images, order=order, global_batch=8, share=share, micro_batch=2,
                                   start_step=1, seed=7, labels=labels)
        try:
            for _ in range(4):  # 32 positions from 8 on: over the end of the first epoch of 21 samples
                expected, got = next(thread), next(device)
                assert [len(b) for b in got] == [len(b) for b in expected]
                for e, g in zip(expected, got, strict=True):
                    assert torch.equal(g.images, e.images) and torch.equal(g.flips, e.flips)
                    assert torch.equal(g.labels, e.labels) and g.position == e.position
                    assert np.array_equal(g.indices, e.indices)
                    dropped += int((g.labels == 3).sum())
        finally:
            thread.close()
    assert dropped > 0  # label dropout's null class is in the comparison


def test_the_images_on_the_device_are_a_copy_of_the_tables_in_pieces(monkeypatch):
    """Read-only chunks reach the device whole, also when copied a few rows at a time."""
    array, table = _table(n=23, chunk=5)
    monkeypatch.setattr("raydiff.data.on_device.COPY_BYTES", 3 * 64)  # three images a copy
    images = DeviceImages(table, CPU)
    assert torch.equal(images.images, torch.from_numpy(array)) and images.nbytes == array.nbytes


def test_auto_keeps_the_images_on_the_host_off_cuda_and_true_and_false_are_obeyed():
    _, table = _table()
    assert place_images("auto", table, CPU) == (None, "data on the host (data.on_device auto: not CUDA)")
    assert place_images(False, table, CPU) == (None, "data on the host")
    images, phrase = place_images(True, table, CPU)
    assert isinstance(images, DeviceImages) and phrase == "data on the cpu (0.0 MB)"


def _parts(seed: int = 0):
    cfg = load_config("smoke", ["model.dropout=0.1", "data.flip=true"])
    torch.manual_seed(seed)
    model = build_model(cfg)
    parts = StepParts.build(model, build_diffusion(cfg), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                            torch.amp.GradScaler("cpu", enabled=False), device=CPU, autocast_dtype=None, seed=3,
                            flip=True, global_batch=8, world_size=1, grad_clip=1.0, dropout=True)
    ema = make_ema(model)
    return parts, model, ema, EmaUpdater(ema, model)


def test_a_run_on_batches_gathered_on_the_device_trains_bit_identically():
    """Six optimizer steps of two micro-batches each, with flips, dropout and the EMA, from a resumed position:
    the weights and the EMA end equal, bit for bit, to those trained on the loader thread's batches."""
    _, table = _table(n=40, chunk=7, shape=(1, 16, 16))
    order = SampleOrder(40, seed=3)
    share = rank_share(8, 1, 0)
    streams = [BatchStream(table=table, order=order, global_batch=8, share=share, micro_batch=4, start_step=3,
                           pin_memory=False, noise=(3, 1000)),
               DeviceBatchStream(images=DeviceImages(table, CPU), order=order, global_batch=8, share=share,
                                 micro_batch=4, start_step=3, seed=3)]
    trained = []
    for stream in streams:
        parts, model, ema, update = _parts()
        try:
            losses = [float(optimizer_step(parts, next(stream), lr=1e-3, ema=update, ema_decay=0.9,
                                           step=step).loss_sum) for step in range(4, 10)]
        finally:
            stream.close()
        trained.append((losses, model.state_dict(), ema.state_dict()))
    (losses, model, ema), (device_losses, device_model, device_ema) = trained
    assert device_losses == losses
    assert all(torch.equal(device_model[k], model[k]) for k in model)
    assert all(torch.equal(device_ema[k], ema[k]) for k in ema)
