"""Writing generated images: a grid PNG, or a folder of single PNGs plus the grid."""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from raydiff.storage.atomic import new_file

MIN_GRID_PX = 512  # grids of small images (digits are 16 px) are enlarged, nearest-neighbour, to at least this width


def _to_unit(images: torch.Tensor) -> torch.Tensor:
    return ((images.detach().float().cpu().clamp(-1, 1) + 1) / 2)


def _png(tensor: torch.Tensor) -> bytes:
    from torchvision.utils import save_image  # imported here: torchvision adds seconds to every start-up

    buffer = io.BytesIO()
    save_image(tensor, buffer, format="png")
    return buffer.getvalue()


def _save_atomically(tensor: torch.Tensor, path: Path) -> None:
    with new_file(path) as tmp:
        tmp.write_bytes(_png(tensor))


def _grid(images: torch.Tensor, nrow: int | None = None) -> torch.Tensor:
    from torchvision.utils import make_grid

    unit = _to_unit(images)
    nrow = nrow or math.ceil(math.sqrt(len(unit)))
    scale = math.ceil(MIN_GRID_PX / (nrow * unit.shape[-1]))
    if scale > 1:
        unit = F.interpolate(unit, scale_factor=scale, mode="nearest")
    return make_grid(unit, nrow=nrow, padding=2, pad_value=0.5)


def save_grid(images: torch.Tensor, path: Path, nrow: int | None = None) -> Path:
    """Images in [-1, 1], (N, C, H, W) -> one PNG grid, 2 px padding: `nrow` images per row (a class-conditional
    grid: one row per class), or as square as possible."""
    _save_atomically(_grid(images, nrow), Path(path))
    return Path(path)


def grid_png(images: torch.Tensor, nrow: int | None = None) -> bytes:
    """The grid of `save_grid` as PNG bytes (for run directories on an object store)."""
    return _png(_grid(images, nrow))


def save_samples(images: torch.Tensor, out: Path, nrow: int | None = None) -> Path:
    """`out` ending in .png -> one grid; otherwise a folder with sample_00000.png ... plus grid.png (`nrow`: as
    `save_grid`)."""
    out = Path(out)
    if out.suffix.lower() == ".png":
        return save_grid(images, out, nrow)
    # All of them, or none: written in a hidden folder inside, then moved out of it (renames need no room).
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".raydiff-samples-", dir=out) as staging:
        for i, image in enumerate(_to_unit(images)):
            _save_atomically(image, Path(staging) / f"sample_{i:05d}.png")
        save_grid(images, Path(staging) / "grid.png", nrow)
        for written in sorted(Path(staging).iterdir()):
            os.replace(written, out / written.name)
    return out


def image_labels(classes: Sequence[int], num: int) -> list[int]:
    """The class of each of `num` images: contiguous blocks, image i gets classes[i * C // num]."""
    return [classes[i * len(classes) // num] for i in range(num)]


def grid_row(classes: Sequence[int], num: int) -> int | None:
    """Images per grid row: one row per class where the classes divide the images evenly (else a square grid)."""
    return num // len(classes) if len(classes) > 1 and num % len(classes) == 0 else None
