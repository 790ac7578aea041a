from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from raydiff.runs.checkpoint import checkpoint_name, list_checkpoints, read_state, write_state
from raydiff.runs.images import save_samples
from raydiff.runs.state import read_newest


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
    latest, state = read_newest(tmp_path)
    assert state["step"] == 20 and latest.name == "checkpoint_00000020"
    assert read_newest(latest)[0] == latest
    with pytest.raises(FileNotFoundError):
        read_newest(tmp_path / "nope")


def test_the_newest_checkpoint_that_reads_is_used(tmp_path, capsys):
    """A checkpoint still being written (Ray uploads it file by file) is named in one line and skipped."""
    for step in (10, 20):
        directory = tmp_path / checkpoint_name(step)
        directory.mkdir()
        write_state(directory, {"step": step, "w": torch.ones(2)})
    newest = tmp_path / "checkpoint_00000020" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    checkpoint, state = read_newest(tmp_path)
    assert state["step"] == 10 and checkpoint.name == "checkpoint_00000010"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "checkpoint_00000020 cannot be read" in warning[0]
    assert warning[0].endswith("using checkpoint_00000010")
    (tmp_path / "checkpoint_00000010" / "state.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no checkpoint can be read: checkpoint_00000020 .*; checkpoint_0000"):
        read_newest(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint can be read"):
        read_newest(tmp_path / "checkpoint_00000020")  # one checkpoint named: no fallback


class Evil:
    pass


def test_checkpoints_refuse_pickled_code(tmp_path):
    torch.save({"x": Evil()}, tmp_path / "state.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        read_state(tmp_path)
