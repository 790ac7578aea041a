"""Writing generated images: grids (one row per class for a class-conditional model), folders of single PNGs,
and which class each image gets."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from raydiff.runs.images import MIN_GRID_PX, grid_png, grid_row, image_labels, save_samples


def test_each_class_gets_a_contiguous_block_and_a_row_of_its_own_where_they_divide_evenly():
    assert image_labels([2, 0, 1], 6) == [2, 2, 0, 0, 1, 1]
    assert image_labels([4], 3) == [4, 4, 4]
    assert grid_row([2, 0, 1], 6) == 2
    assert grid_row([2, 0, 1], 7) is None and grid_row([5], 4) is None  # a square grid


def test_a_grid_of_small_images_is_enlarged_and_maps_minus_one_to_one_onto_black_to_white():
    images = torch.cat([torch.full((2, 1, 8, 8), -1.0), torch.full((2, 1, 8, 8), 1.0)])
    grid = np.asarray(Image.open(io.BytesIO(grid_png(images, nrow=2))).convert("L"))
    assert grid.shape[1] >= MIN_GRID_PX  # 2 columns of 8 px, enlarged nearest-neighbour
    cell = (grid.shape[1] - 6) // 2  # 2 px padding around and between cells
    assert grid[2 + cell // 2, 2 + cell // 2] == 0  # the first image is black
    assert grid[grid.shape[0] - 3 - cell // 2, 2 + cell // 2] == 255  # the third (second row) is white


def test_samples_go_to_one_png_or_a_folder_of_pngs_with_their_grid(tmp_path):
    images = torch.rand(3, 1, 8, 8) * 2 - 1
    assert save_samples(images, tmp_path / "grid.png") == tmp_path / "grid.png"
    assert Image.open(tmp_path / "grid.png").size[0] >= MIN_GRID_PX
    folder = save_samples(images, tmp_path / "many")
    assert sorted(p.name for p in folder.iterdir()) == ["grid.png", "sample_00000.png", "sample_00001.png",
                                                         "sample_00002.png"]
    pixels = np.asarray(Image.open(folder / "sample_00001.png").convert("L")).astype(float)
    expected = ((images[1, 0].clamp(-1, 1) + 1) / 2 * 255).numpy()
    assert np.abs(pixels - expected).max() <= 1
    assert not list(tmp_path.rglob(".*.tmp"))  # written beside and renamed
    (folder / "notes.txt").write_text("mine")
    save_samples(images[:2], folder)  # again, fewer: this call's samples only, the user's file kept
    assert sorted(p.name for p in folder.iterdir()) == ["grid.png", "notes.txt", "sample_00000.png",
                                                         "sample_00001.png"]


def test_a_grid_named_jpg_or_webp_is_one_image_in_that_format_not_a_folder_of_that_name(tmp_path):
    """Anything but .png was a folder: `--out grid.jpg` made a folder called grid.jpg."""
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1  # noise: lossy's worst case
    png = np.asarray(Image.open(save_samples(images, tmp_path / "grid.png"))).astype(float)
    for name, image_format in [("grid.jpg", "JPEG"), ("GRID.JPEG", "JPEG"), ("grid.webp", "WEBP")]:
        written = save_samples(images, tmp_path / name)
        assert written == tmp_path / name and written.is_file()
        with Image.open(written) as grid:
            assert grid.format == image_format and grid.size == Image.open(tmp_path / "grid.png").size
            # Quality 95: 2.9 levels from the PNG on average here; Pillow's default quality, 3.8 (WebP) to 4.8 (JPEG).
            assert np.abs(np.asarray(grid).astype(float) - png).mean() < 3.3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["GRID.JPEG", "grid.jpg", "grid.png", "grid.webp"]
