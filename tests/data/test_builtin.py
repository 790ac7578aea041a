from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raydiff import datasets as datasets_cli
from raydiff.data import builtin


def test_digits_are_written_once_as_png(tmp_path):
    folder = builtin.digits_folder()
    files = sorted(folder.glob("*.png"))
    assert len(files) == 1797
    image = Image.open(files[0])
    assert image.size == (8, 8) and image.mode == "L"
    assert builtin.digits_folder() == folder  # cached
    assert folder.parent == builtin.cache_dir()


@pytest.mark.parametrize("fmt, resolution", [("png", 32), ("jpg", 48), ("png", 7)])
def test_synthetic_images(tmp_path, fmt, resolution):
    paths = builtin.write_synthetic(tmp_path, num=5, resolution=resolution, fmt=fmt, seed=1)
    assert [p.suffix for p in paths] == [f".{fmt}"] * 5
    image = Image.open(paths[0])
    assert image.size == (resolution, resolution) and image.mode == "RGB"
    again = builtin.write_synthetic(tmp_path / "again", num=5, resolution=resolution, fmt=fmt, seed=1)
    assert np.array_equal(np.asarray(Image.open(again[3])), np.asarray(Image.open(paths[3])))


def test_synthetic_cli(tmp_path):
    assert datasets_cli.main(["synthetic", str(tmp_path / "s"), "--num", "3", "--resolution", "16"]) == 0
    assert len(list(Path(tmp_path / "s").glob("*.png"))) == 3
