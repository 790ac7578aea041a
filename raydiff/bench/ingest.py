"""`python -m raydiff.bench ingest`: raydiff's training ingest against the textbook torch DataLoader.

All three pipelines read the same files on the same cores in one run and deliver shuffled, flipped float
batches in [-1, 1] at the target resolution to a consumer loop that moves them to the training device:

- `dataloader` (baseline): torchvision Resize + CenterCrop + RandomHorizontalFlip + ToTensor + Normalize in a
  DataLoader with 2 workers, pin_memory, persistent workers and prefetch 2, decoding every image every epoch;
- `raw`: raydiff from the raw files (Ray Data decodes once, then every epoch gathers from the object store);
- `cached`: raydiff from the same files prepared by `raydiff.prepare` (Parquet shards, no decoding).

Steady-state img/s excludes the first epoch (worker start-up, raydiff's decode) and covers whole epochs for at
least MIN_STEADY_S; the first epoch's seconds are reported too, because that is where decoding costs.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

SYNTHETIC_SOURCE_RESOLUTION = 64
MIN_STEADY_S = 3.0  # a fast pipeline runs more epochs, so that its rate is not a few milliseconds' sample


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


def _raydiff_batches(source, resolution: int, batch: int, seed: int = 0):
    """raydiff's training ingest for one worker taking the whole global batch: decode/load, then stream."""
    from raydiff.data.ingest import load_images
    from raydiff.data.loader import BatchStream, ImageTable
    from raydiff.data.order import SampleOrder, Share

    store = load_images(source, resolution=resolution, channels=3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stream = BatchStream(table=ImageTable(store.arrays()), order=SampleOrder(store.usable_indices(), seed),
                         global_batch=batch, share=Share(0, batch), micro_batch=batch, start_step=0,
                         pin_memory=device.type == "cuda")
    try:
        for micro_batches in stream:
            for b in micro_batches:
                yield b.to_device(device, flip=True)
    finally:
        stream.close()


def bench_ingest(source: str | None, *, resolution: int, batch: int, epochs: int, synthetic: int) -> dict:
    import ray

    from raydiff.data.datasets import write_synthetic
    from raydiff.data.sources import open_source
    from raydiff.prepare import write_prepared

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as tmp:
        if source is None:
            source = str(Path(tmp) / "jpegs")
            write_synthetic(Path(source), num=synthetic, resolution=SYNTHETIC_SOURCE_RESOLUTION, fmt="jpg")
        raw = open_source(source, format="images")
        paths = list(raw.files)
        epoch = len(paths) // batch * batch
        if epoch == 0:
            raise ValueError(f"--batch {batch}: more than the {len(paths)} images of the source")
        result = {"bench": "ingest", "source": source, "images": len(paths), "resolution": resolution,
                  "batch": batch, "epochs": epochs, "cpus": cpus, "device": str(device)}

        # Baseline first, before Ray takes any memory or processes.
        first, steady = _consume(_dataloader(paths, resolution, batch, workers=2), device, epochs, epoch)
        result.update(dataloader_img_s=round(steady), dataloader_first_epoch_s=round(first, 2))

        ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", address="local")
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            first, steady = _consume(_raydiff_batches(raw, resolution, batch), device, epochs, epoch)
            result.update(raw_img_s=round(steady), raw_first_epoch_s=round(first, 2))

            prepare_start = time.perf_counter()
            from raydiff.data.ingest import load_images

            write_prepared(load_images(raw, resolution=resolution, channels=3), raw, str(Path(tmp) / "prepared"))
            result["prepare_s"] = round(time.perf_counter() - prepare_start, 2)
            cached = open_source(str(Path(tmp) / "prepared"))
            first, steady = _consume(_raydiff_batches(cached, resolution, batch), device, epochs, epoch)
            result.update(cached_img_s=round(steady), cached_first_epoch_s=round(first, 2))
        finally:
            ray.shutdown()
    result["raw_ratio"] = round(result["raw_img_s"] / result["dataloader_img_s"], 2)
    result["cached_ratio"] = round(result["cached_img_s"] / result["dataloader_img_s"], 2)
    result["raw_first_epoch_ratio"] = round(result["dataloader_first_epoch_s"] / result["raw_first_epoch_s"], 2)
    result["cached_first_epoch_ratio"] = round(result["dataloader_first_epoch_s"] / result["cached_first_epoch_s"], 2)
    return result
