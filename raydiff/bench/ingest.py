"""`python -m raydiff.bench ingest`: raydiff's training ingest against the textbook torch DataLoader.

All three pipelines read the same files on the same cores in one run and deliver shuffled, flipped float
batches in [-1, 1] at the target resolution to a consumer loop that moves them to the training device:

- `dataloader` (baseline): torchvision Resize + CenterCrop + RandomHorizontalFlip + ToTensor + Normalize in a
  DataLoader with 2 workers, pin_memory, persistent workers and prefetch 2, decoding every image every epoch;
- `raw`: raydiff from the raw files (Ray Data decodes once, then every epoch gathers from the object store);
- `cached`: raydiff from the same files prepared by `raydiff.prepare` (Parquet shards, no decoding), held in
  the object store (`data.cache=memory`);
- `stream` (with `--cache stream`): the same prepared files cut into STREAM_SHARDS shards and streamed
  (`data.cache=stream`) through the node's cache actor, in windows of STREAM_WINDOW shards, with the smallest
  buffer that allows them (WINDOWS_HELD windows).

Steady-state img/s excludes the first epoch (worker start-up, raydiff's decode) and covers whole epochs for at
least MIN_STEADY_S; the first epoch's seconds are reported too, because that is where decoding costs. For each
raydiff pipeline the node's object-store bytes and the consuming process's RSS are sampled while it runs; the
peaks above what was in use when it started are `*_peak_store_mb` and `*_peak_rss_mb`.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SYNTHETIC_SOURCE_RESOLUTION = 64  # the synthetic JPEGs' size, or a quarter more than the training resolution
MIN_STEADY_S = 3.0  # a fast pipeline runs more epochs, so that its rate is not a few milliseconds' sample
STREAM_SHARDS, STREAM_WINDOW = 16, 2


class _Peaks:
    """Samples the node's object-store bytes in use and this process's RSS every 50 ms, in a thread; keeps the
    peaks above the levels at the start."""

    def __init__(self) -> None:
        import threading

        import psutil
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        self._state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self._reply, self._process = get_memory_info_reply, psutil.Process()
        self._store_before, self._rss_before = self._store_used(), self._process.memory_info().rss
        self.store = self.rss = 0  # peaks above what was in use before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _store_used(self) -> int:
        return self._reply(self._state).store_stats.object_store_bytes_used

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.store = max(self.store, self._store_used() - self._store_before)
            self.rss = max(self.rss, self._process.memory_info().rss - self._rss_before)

    def __enter__(self) -> _Peaks:  # noqa: PYI034 -- typing.Self is Python 3.11+, raydiff runs on 3.10
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _consume(batches, device: torch.device, epochs: int, epoch_images: int) -> tuple[float, float]:
    """Pull at least `epochs` epochs of `epoch_images` images, and whole epochs for at least MIN_STEADY_S after
    the first; return (first epoch s, steady img/s after the first epoch)."""
    start = time.perf_counter()
    delivered, first_epoch_s = 0, None
    for x in batches:
        x = x.to(device, non_blocking=True)
        delivered += len(x)
        if first_epoch_s is None and delivered >= epoch_images:
            first_epoch_s, steady_start, steady_from = time.perf_counter() - start, time.perf_counter(), delivered
        if (delivered >= epochs * epoch_images and delivered % epoch_images == 0
                and time.perf_counter() - steady_start >= MIN_STEADY_S):
            break
    batches.close()  # stop the producer (loader thread or worker processes)
    assert first_epoch_s is not None  # set when the first epoch ends, before the loop can stop
    return first_epoch_s, (delivered - steady_from) / (time.perf_counter() - steady_start)


class _Files(torch.utils.data.Dataset):
    def __init__(self, paths: list[str], transform) -> None:
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.paths[i]) as image:
            return self.transform(image.convert("RGB"))


def _dataloader(paths: list[str], resolution: int, batch: int, workers: int):
    from torchvision import transforms

    transform = transforms.Compose([
        transforms.Resize(resolution), transforms.CenterCrop(resolution), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    loader = torch.utils.data.DataLoader(_Files(paths, transform), batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, pin_memory=torch.cuda.is_available(),
                                         persistent_workers=True, prefetch_factor=2)
    while True:
        yield from loader


def _raydiff_batches(source, resolution: int, batch: int, seed: int = 0, stream_buffer_gb: float | None = None):
    """raydiff's training ingest for one worker taking the whole global batch: decode/load (or stream, with a
    buffer), then gather."""
    import numpy as np

    from raydiff.config import DataSection
    from raydiff.data.loader import BatchStream
    from raydiff.data.order import Share
    from raydiff.data.run_images import open_images, open_tables

    data = DataSection(source=source.uri, resolution=resolution, channels=3,
                       cache="memory" if stream_buffer_gb is None else "stream",
                       stream_buffer_gb=stream_buffer_gb or 1.0, stream_window_shards=STREAM_WINDOW)
    images, _ = open_images(data, source, storage=source.uri, endpoint=None)
    table, order, _, _ = open_tables(images, images.usable_indices(), np.empty(0, np.int64), seed, group="bench")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stream = BatchStream(table=table, order=order, global_batch=batch, share=Share(0, batch), micro_batch=batch,
                         start_step=0, pin_memory=device.type == "cuda")
    try:
        for micro_batches in stream:
            for b in micro_batches:
                yield b.to_device(device, flip=True)
    finally:
        stream.close()


def _measure(result: dict, name: str, batches, device, epochs: int, epoch: int) -> None:
    with _Peaks() as peaks:
        first, steady = _consume(batches, device, epochs, epoch)
    result.update({f"{name}_img_s": round(steady), f"{name}_first_epoch_s": round(first, 2),
                   f"{name}_peak_store_mb": round(peaks.store / 2 ** 20, 1),
                   f"{name}_peak_rss_mb": round(peaks.rss / 2 ** 20, 1)})


def bench_ingest(source: str | None, *, resolution: int, batch: int, epochs: int, synthetic: int,
                 cache: str = "memory") -> dict:
    import logging

    import ray

    from raydiff.data.builtin import write_synthetic
    from raydiff.data.shard_format import write_prepared
    from raydiff.data.sources import open_source

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as tmp:
        if source is None:
            source = str(Path(tmp) / "jpegs")
            # Larger than the training resolution, as real photos are: the decode resizes them down.
            size = max(SYNTHETIC_SOURCE_RESOLUTION, resolution + resolution // 4)
            write_synthetic(Path(source), num=synthetic, resolution=size, fmt="jpg")
        raw = open_source(source, format="images")
        paths = list(raw.files)
        epoch = len(paths) // batch * batch
        if epoch == 0:
            raise ValueError(f"--batch {batch}: more than the {len(paths)} images of the source")
        result: dict[str, Any] = {"bench": "ingest", "source": source, "images": len(paths),
                                  "resolution": resolution, "batch": batch, "epochs": epochs, "cpus": cpus,
                                  "device": str(device)}

        # Baseline first, before Ray takes any memory or processes.
        first, steady = _consume(_dataloader(paths, resolution, batch, workers=2), device, epochs, epoch)
        result.update(dataloader_img_s=round(steady), dataloader_first_epoch_s=round(first, 2))

        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR, address="local")
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            _measure(result, "raw", _raydiff_batches(raw, resolution, batch), device, epochs, epoch)

            from raydiff.data.image_store import decode_stream

            prepare_start = time.perf_counter()
            prepared = str(Path(tmp) / "prepared")
            shape = (3, resolution, resolution)
            write_prepared(decode_stream(raw, resolution=resolution, channels=3), raw, prepared, shape=shape,
                           rows_per_shard=-(-len(paths) // STREAM_SHARDS))
            result["prepare_s"] = round(time.perf_counter() - prepare_start, 2)
            cached = open_source(prepared)
            _measure(result, "cached", _raydiff_batches(cached, resolution, batch), device, epochs, epoch)
            if cache == "stream":
                from raydiff.data.node_cache import WINDOWS_HELD

                shard_bytes = -(-len(paths) // STREAM_SHARDS) * 3 * resolution ** 2
                buffer_gb = WINDOWS_HELD * STREAM_WINDOW * shard_bytes / 2 ** 30
                _measure(result, "stream", _raydiff_batches(cached, resolution, batch, stream_buffer_gb=buffer_gb),
                         device, epochs, epoch)
                result.update(stream_buffer_mb=round(buffer_gb * 1024, 1), stream_shards=STREAM_SHARDS,
                              stream_window_shards=STREAM_WINDOW,
                              decoded_mb=round(len(paths) * 3 * resolution ** 2 / 2 ** 20, 1))
        finally:
            ray.shutdown()
    result["raw_ratio"] = round(result["raw_img_s"] / result["dataloader_img_s"], 2)
    result["cached_ratio"] = round(result["cached_img_s"] / result["dataloader_img_s"], 2)
    result["raw_first_epoch_ratio"] = round(result["dataloader_first_epoch_s"] / result["raw_first_epoch_s"], 2)
    result["cached_first_epoch_ratio"] = round(result["dataloader_first_epoch_s"] / result["cached_first_epoch_s"], 2)
    if cache == "stream":
        result["stream_ratio"] = round(result["stream_img_s"] / result["dataloader_img_s"], 2)
        result["stream_vs_memory"] = round(result["stream_img_s"] / result["cached_img_s"], 2)
    return result
