"""Ray Data ingest through the real pipeline."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from raydiff.datasets import write_synthetic
from raydiff.ingest import DataError, decode_resize_crop, list_image_files, load_images

pytestmark = pytest.mark.ray


def test_folder_is_decoded_resized_and_cropped_in_order(ray_session, tmp_path):
    write_synthetic(tmp_path / "b", num=7, resolution=40, fmt="jpg", seed=1)
    write_synthetic(tmp_path / "a" / "nested", num=5, resolution=20, fmt="png", seed=2)
    Image.new("RGB", (30, 12), (200, 10, 10)).save(tmp_path / "wide.png")  # non-square: center crop
    (tmp_path / "notes.txt").write_text("not an image")
    files = list_image_files(str(tmp_path))
    assert len(files) == 13 and files == sorted(files)

    store = load_images(str(tmp_path), resolution=16, channels=3)
    assert store.num_images == 13 and store.shape == (3, 16, 16)
    images = np.concatenate(store.arrays())
    assert images.dtype == np.uint8 and images.shape == (13, 3, 16, 16)
    for i, path in enumerate(files):  # sample i is file i, decoded exactly as decode_resize_crop does
        assert np.array_equal(images[i], decode_resize_crop(open(path, "rb").read(), 16, 3))
    assert np.all(images[-1][0] == 200) and np.all(images[-1][1] == 10)


def test_grayscale_digits(ray_session):
    store = load_images("builtin:digits", resolution=16, channels=1)
    assert store.num_images == 1797 and store.shape == (1, 16, 16)
    assert np.concatenate(store.arrays()).max() > 200


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        list_image_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images found"):
        list_image_files(str(tmp_path / "empty"))
