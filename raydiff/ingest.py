"""Ray Data ingest: list a source's images, decode, resize, center-crop, and keep them as uint8 in the object store.

Decoding happens once, in parallel Ray Data tasks, before training starts. The result is an `ImageStore`:
uint8 CHW chunks in the Ray object store, in a fixed order (sorted file paths) so that sample index i means
the same image in every run. Workers read the chunks zero-copy from shared memory and draw batches in the
order given by `raydiff.order`; the per-epoch work (flip, scale to [-1, 1]) happens on the training device.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from PIL import Image, ImageOps

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
CHUNK_BYTES = 64 * 1024 * 1024  # object-store chunk size: few chunks, cheap gathers


class DataError(ValueError):
    """The data source cannot be used (missing, empty); the message is one line for the user."""


def source_folder(source: str) -> Path:
    from raydiff.datasets import builtin_folder

    if source.startswith("builtin:"):
        return builtin_folder(source)
    return Path(source.removeprefix("file://")).expanduser().resolve()


def list_image_files(source: str) -> list[str]:
    """Every image file below the source folder (recursive), sorted so that the order is reproducible."""
    folder = source_folder(source)
    if not folder.exists():
        raise DataError(f"data.source = {source!r}: no such file or folder")
    if folder.is_file():
        files = [folder] if folder.suffix.lower() in IMAGE_EXTENSIONS else []
    else:
        files = [p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]
    if not files:
        raise DataError(f"data.source = {source!r}: no images found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    return sorted(str(p) for p in files)


def decode_resize_crop(data: bytes, resolution: int, channels: int) -> np.ndarray:
    """One encoded image -> uint8 array (C, R, R): scaled to cover R x R (antialiased bicubic), center-cropped."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft("L" if channels == 1 else "RGB", (resolution, resolution))  # JPEG: decode at reduced scale
        image = ImageOps.fit(image.convert("L" if channels == 1 else "RGB"), (resolution, resolution),
                             method=Image.Resampling.BICUBIC)
        array = np.asarray(image, dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def _decode_batch(batch: dict[str, np.ndarray], resolution: int, channels: int) -> dict[str, np.ndarray]:
    return {"image": np.stack([decode_resize_crop(b, resolution, channels) for b in batch["bytes"]])}


@ray.remote(num_cpus=0)
def _num_rows(array: np.ndarray) -> int:
    return len(array)


@dataclass(frozen=True)
class ImageStore:
    """A dataset decoded to uint8 (N, C, R, R), held as object-store chunks; picklable, so it travels to workers."""

    chunks: tuple[ray.ObjectRef, ...]
    counts: tuple[int, ...]
    shape: tuple[int, int, int]
    source: str

    @property
    def num_images(self) -> int:
        return sum(self.counts)

    def arrays(self) -> list[np.ndarray]:
        """The chunks as read-only numpy arrays; zero-copy when the chunk is on this node."""
        return ray.get(list(self.chunks))


def load_images(source: str, *, resolution: int, channels: int, files: list[str] | None = None) -> ImageStore:
    """Decode every image of `source` (or the given listing of it) once with Ray Data; return an `ImageStore`."""
    files = files if files is not None else list_image_files(source)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # sample i must be the same image in every run
    rows_per_chunk = max(1, CHUNK_BYTES // (channels * resolution * resolution))
    ds = (
        ray.data.read_binary_files(files)
        .map_batches(_decode_batch, fn_kwargs={"resolution": resolution, "channels": channels},
                     batch_size=256, batch_format="numpy")
        .repartition(target_num_rows_per_block=rows_per_chunk)
    )
    chunks = ds.to_numpy_refs(column="image")
    counts = ray.get([_num_rows.remote(c) for c in chunks])
    nonempty = [(c, n) for c, n in zip(chunks, counts) if n]
    return ImageStore(
        chunks=tuple(c for c, _ in nonempty), counts=tuple(n for _, n in nonempty),
        shape=(channels, resolution, resolution), source=source,
    )
