"""Writing generated images: one grid (PNG, or JPEG / WebP where the name asks), or a folder of single PNGs plus
the grid.

torch and torchvision are imported where they are used: `raydiff.sample` checks its --out with `is_grid_file`
before it loads them (seconds), so that a mistake is answered at once.
"""

from __future__ import annotations

import errno
import io
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from raydiff.storage.atomic import new_file

if TYPE_CHECKING:
    import torch

MIN_GRID_PX = 512  # grids of small images (digits are 16 px) are enlarged, nearest-neighbour, to at least this width
# A grid's file name ending -> Pillow's format and options: the lossy ones at a quality that keeps the enlarged
# pixels' edges (Pillow's defaults blur them).
GRID_FORMATS = {".png": ("PNG", {}), ".jpg": ("JPEG", {"quality": 95}), ".jpeg": ("JPEG", {"quality": 95}),
                ".webp": ("WEBP", {"quality": 95})}


def _to_unit(images: torch.Tensor) -> torch.Tensor:
    return ((images.detach().float().cpu().clamp(-1, 1) + 1) / 2)


def is_grid_file(path: Path) -> bool:
    """Whether `save_samples` writes `path` as one grid image (else: a folder)."""
    return Path(path).suffix.lower() in GRID_FORMATS


def _encode(tensor: torch.Tensor, suffix: str = ".png") -> bytes:
    """An image in [0, 1], (C, H, W), as the bytes of a file named `*suffix`, rounded as torchvision's save_image."""
    import torch
    from PIL import Image
    from torchvision.utils import make_grid

    image_format, options = GRID_FORMATS[suffix.lower()]
    pixels = make_grid(tensor).mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to(torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=image_format, **options)
    return buffer.getvalue()


def _save_atomically(tensor: torch.Tensor, path: Path, *, durable: bool = True) -> None:
    with new_file(path, durable=durable) as tmp:
        tmp.write_bytes(_encode(tensor, path.suffix))


def _grid(images: torch.Tensor, nrow: int | None = None) -> torch.Tensor:
    import torch
    from torchvision.utils import make_grid

    unit = _to_unit(images)
    nrow = nrow or math.ceil(math.sqrt(len(unit)))
    scale = math.ceil(MIN_GRID_PX / (nrow * unit.shape[-1]))
    if scale > 1:
        unit = torch.nn.functional.interpolate(unit, scale_factor=scale, mode="nearest")
    return make_grid(unit, nrow=nrow, padding=2, pad_value=0.5)


def save_grid(images: torch.Tensor, path: Path, nrow: int | None = None) -> Path:
    """Images in [-1, 1], (N, C, H, W) -> one grid image in the format `path` names (GRID_FORMATS), 2 px padding:
    `nrow` images per row (a class-conditional grid: one row per class), or as square as possible."""
    _save_atomically(_grid(images, nrow), Path(path))
    return Path(path)


def grid_png(images: torch.Tensor, nrow: int | None = None) -> bytes:
    """The grid of `save_grid` as PNG bytes (for run directories on an object store)."""
    return _encode(_grid(images, nrow))


def save_samples(images: torch.Tensor, out: Path, nrow: int | None = None) -> Path:
    """`out` ending in .png, .jpg, .jpeg or .webp -> one grid; otherwise a folder with sample_00000.png ... plus
    grid.png (`nrow`: as `save_grid`), whose sample_NNNNN.png of an earlier, larger call are removed: the folder
    holds this call's samples, not a mix. Other files in it stay."""
    out = Path(out)
    if is_grid_file(out):
        return save_grid(images, out, nrow)
    # All of them, or none: written in a hidden folder inside, then moved out of it (renames need no room).
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".raydiff-samples-", dir=out) as staging:
        for i, image in enumerate(_to_unit(images)):  # no fsync each: tens of thousands, and made again at will
            _save_atomically(image, Path(staging) / f"sample_{i:05d}.png", durable=False)
        save_grid(images, Path(staging) / "grid.png", nrow)
        written = sorted(Path(staging).iterdir())
        taken = next((out / w.name for w in written if (out / w.name).is_dir()), None)
        if taken is not None:  # a folder of that name: found before the first rename, not after some
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(taken))
        for file in written:
            os.replace(file, out / file.name)
    for earlier in out.glob("sample_*.png"):
        number = earlier.name[len("sample_"):-len(".png")]
        if number.isdigit() and int(number) >= len(images):
            earlier.unlink(missing_ok=True)
    return out


def image_labels(classes: Sequence[int], num: int) -> list[int]:
    """The class of each of `num` images: contiguous blocks, image i gets classes[i * C // num]."""
    return [classes[i * len(classes) // num] for i in range(num)]


def grid_row(classes: Sequence[int], num: int) -> int | None:
    """Images per grid row: one row per class where the classes divide the images evenly (else a square grid)."""
    return num // len(classes) if len(classes) > 1 and num % len(classes) == 0 else None
