from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from raydiff.runs.checkpoint import checkpoint_name, list_checkpoints, read_state, resolve_checkpoint, write_state
from raydiff.runs.images import save_samples


def test_grid_and_folder(tmp_path):
    images = torch.linspace(-1, 1, 5 * 3 * 16 * 16).reshape(5, 3, 16, 16)
    grid = save_samples(images, tmp_path / "grid.png")
    # 3 columns of 16 px enlarged 11x (nearest neighbour) to pass 512 px, 2 px padding
    assert Image.open(grid).size == (3 * (176 + 2) + 2, 2 * (176 + 2) + 2)
    tile = np.asarray(Image.open(grid))[2:2 + 176, 2:2 + 176]
    assert (tile[::11, ::11].repeat(11, 0).repeat(11, 1) == tile).all()  # blocks of 11x11 equal pixels
    digits = save_samples(torch.zeros(64, 1, 16, 16), tmp_path / "digits.png")
    assert Image.open(digits).size[0] == 8 * (64 + 2) + 2  # the default run's grid: 530 px wide
    folder = save_samples(images, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["grid.png"] + [f"sample_{i:05d}.png" for i in range(5)]
    assert Image.open(folder / "sample_00004.png").size == (16, 16)


def test_state_round_trip_and_lookup(tmp_path):
    for step in (10, 20):
        directory = tmp_path / checkpoint_name(step)
        directory.mkdir()
        write_state(directory, {"step": step, "w": torch.ones(2), "config": {"a": [1, 2]}})
    (tmp_path / "checkpoint_00000030").mkdir()  # incomplete: no state file
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_00000010", "checkpoint_00000020"]
    latest = resolve_checkpoint(tmp_path)
    assert read_state(latest)["step"] == 20
    assert resolve_checkpoint(latest) == latest and latest.name == "checkpoint_00000020"
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path / "nope")


class Evil:
    pass


def test_checkpoints_refuse_pickled_code(tmp_path):
    torch.save({"x": Evil()}, tmp_path / "state.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        read_state(tmp_path)
