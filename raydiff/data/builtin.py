"""Built-in datasets: scikit-learn's handwritten digits written as PNG files, and synthetic RGB images.

Both are plain image folders on disk, so they go through exactly the same Ray Data path as a user's folder.
Nothing is downloaded: the digits ship inside scikit-learn, the synthetic images are drawn here.

The command line is `python -m raydiff.datasets`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from raydiff.data.errors import DataError
from raydiff.storage.atomic import new_folder
from raydiff.storage.errors import FULL, permanent_reason


def cache_dir() -> Path:
    """Where built-in datasets are written: $RAYDIFF_CACHE, else $XDG_CACHE_HOME/raydiff, else ~/.cache/raydiff."""
    if os.environ.get("RAYDIFF_CACHE"):
        try:
            return Path(os.environ["RAYDIFF_CACHE"]).expanduser().resolve()
        except RuntimeError:  # ~user of no user here
            raise _cache_refused("its ~ names no home folder on this machine") from None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base / "raydiff").expanduser().resolve()


def _cache_refused(reason: str) -> DataError:
    """RAYDIFF_CACHE's value is no folder raydiff can write into: one line naming it (the variable, set once, is
    easily forgotten, and Python's error names only a path)."""
    return DataError(f"RAYDIFF_CACHE = {os.environ.get('RAYDIFF_CACHE', '')!r}: {reason}; point it at a folder raydiff "
                     f"may write, or unset it")


def _make_cache(folder: Path) -> None:
    """Make the cache folder where it is missing; one that cannot be (a file in its place, a path no folder can be
    made at) is the user's to fix, in one line naming RAYDIFF_CACHE where that chose it. A full disk is left to
    `_publish`, which says so for the whole dataset."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if permanent_reason(exc) in FULL:
            return
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            reason = "not a folder (a file is there)" if existing == folder else f"not a folder ({existing} is a file)"
        else:
            reason = f"cannot make the folder ({permanent_reason(exc) or (exc.strerror or str(exc)).lower()})"
        if os.environ.get("RAYDIFF_CACHE"):
            raise _cache_refused(reason) from None
        raise DataError(f"the cache folder {folder}: {reason}; set RAYDIFF_CACHE to a folder raydiff may write") \
            from None


def _publish(build, target: Path) -> Path:
    """Build a folder under a temporary name and rename it into place, so a reader never sees half of it."""
    if target.is_dir():
        return target
    _make_cache(target.parent)
    try:
        with new_folder(target) as tmp:
            build(tmp)
    except OSError as exc:
        if target.is_dir():  # a concurrent writer that won the race is fine; anything else is not
            return target
        reason = permanent_reason(exc)
        if reason is None:
            raise
        raise DataError(f"cannot write the built-in dataset into {target.parent} ({reason}); make room there or set "
                        f"RAYDIFF_CACHE to another folder") from None
    return target


def digits_folder() -> Path:
    """All 1,797 scikit-learn digits as 8x8 grayscale PNGs, written once into the cache."""

    def build(folder: Path) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # values are 0..16
        for i, (image, label) in enumerate(zip(pixels, digits.target, strict=True)):
            Image.fromarray(image, mode="L").save(folder / f"{i:04d}_digit{label}.png")

    return _publish(build, cache_dir() / "digits-v1")


def builtin_folder(source: str) -> Path:
    name = source.removeprefix("builtin:")
    if name == "digits":
        return digits_folder()
    raise ValueError(f"unknown builtin dataset {source!r}")


def write_synthetic(folder: Path, *, num: int, resolution: int, fmt: str = "png", seed: int = 0) -> list[Path]:
    """Random ellipses and rectangles on coloured backgrounds: cheap RGB images of any size for tests
    and benchmarks. Returns the files written, in order."""
    if fmt not in ("png", "jpg"):
        raise ValueError(f"format {fmt!r}: expected png or jpg")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(num):
        image = Image.new("RGB", (resolution, resolution), tuple(int(c) for c in rng.integers(0, 256, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(1, 4))):
            x0, y0 = rng.integers(0, resolution * 3 // 4, 2)
            w, h = rng.integers(resolution // 8 + 1, resolution // 2 + 2, 2)
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape([int(x0), int(y0), int(x0 + w), int(y0 + h)], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        path = folder / f"synthetic_{i:06d}.{fmt}"
        image.save(path, quality=90) if fmt == "jpg" else image.save(path)
        paths.append(path)
    return paths
