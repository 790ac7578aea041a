"""The LR range test through its CLI."""

from __future__ import annotations

import csv
import math
import re

import pytest
from conftest import run_cli

from raydiff import cli, lr_find


@pytest.mark.ray
def test_lr_find_writes_plot_and_numbers_and_suggests_a_finite_lr(tmp_path):
    out = tmp_path / "found" / "lr_find.png"
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--steps", "40", "--start", "1e-6", "--end", "10",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert 10 <= len(rows) <= 40 and float(rows[0]["lr"]) == pytest.approx(1e-6)
    suggested = float(re.search(r"suggested lr (\S+)", proc.stdout).group(1))
    assert math.isfinite(suggested) and 1e-6 < suggested < 10
    assert "diverged" in proc.stdout  # lr 10 is far past the edge for this model
    assert "on cpu, host memory kept" in proc.stdout  # it trains in its own process, as a CPU worker does


def test_lr_find_rejects_a_backwards_range(tmp_path):
    proc = run_cli("raydiff.lr_find", "--start", "1e-2", "--end", "1e-5", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "need 0 < start < end" in proc.stderr


@pytest.mark.parametrize("flag, value", [("--end", "inf"), ("--end", "1e400"), ("--start", "nan")])
def test_lr_find_refuses_a_learning_rate_that_is_not_finite(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        lr_find.parse_args([flag, value, "--out", str(tmp_path / "x.png")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: {flag} {float(value)}: must be a finite learning rate, such "
                                       f"as 1e-2 (python -m raydiff.lr_find --help)\n")


@pytest.mark.ray
def test_lr_find_trains_a_class_conditional_config_on_the_classes_its_data_has(tmp_path):
    # model.num_classes = auto is resolved from the data's labels, as a run resolves it (was: a traceback).
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", "data.labels=auto", "--set",
                   "model.num_classes=auto", "--steps", "10", "--out", str(tmp_path / "lr_find.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cpu, class-conditional on 10 classes" in proc.stdout
    assert len(list(csv.DictReader((tmp_path / "lr_find.csv").open()))) == 10


@pytest.mark.ray
def test_lr_find_trains_in_the_micro_batches_and_with_the_checkpointing_a_run_would(tmp_path):
    """The memory plan of a one-worker run: a 256x256 preset's `auto` measures what fits on a GPU instead of
    passing the whole batch at once; here a fixed micro-batch and activation checkpointing on, as configured."""
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", "train.micro_batch=4", "--set",
                   "train.activation_checkpointing=true", "--steps", "10", "--out", str(tmp_path / "lr_find.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; micro-batches of up to 4, activation checkpointing on\n" in proc.stdout, proc.stdout
    assert len(list(csv.DictReader((tmp_path / "lr_find.csv").open()))) == 10


@pytest.mark.ray
def test_lr_find_refuses_fewer_classes_than_the_data_has_in_one_line(tmp_path):
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", "data.labels=auto", "--set",
                   "model.num_classes=4", "--steps", "10", "--out", str(tmp_path / "lr_find.png"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("raydiff: config error: model.num_classes = 4: smaller "
                                                           "than the 10 classes found")
    assert not (tmp_path / "lr_find.png").exists()


@pytest.mark.parametrize("out", ["", " "])
def test_lr_find_refuses_an_empty_out_by_what_was_given(capsys, out):
    with pytest.raises(SystemExit) as info:
        lr_find.parse_args(["--out", out])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: --out {out!r}: must end in .png (python -m raydiff.lr_find "
                                       f"--help)\n")


@pytest.mark.parametrize("folder", ["found.png", "found.csv"])
def test_lr_find_refuses_an_out_whose_plot_or_numbers_would_replace_a_folder_before_training(tmp_path, capsys,
                                                                                              folder):
    # Found only once the whole test had run, as a traceback.
    (tmp_path / folder).mkdir()
    out = tmp_path / "found.png"
    with pytest.raises(SystemExit) as info:
        lr_find.parse_args(["--out", str(out)])
    assert info.value.code == 2
    what = "is a folder" if folder == out.name else f"its numbers' file {tmp_path / folder} is a folder"
    assert capsys.readouterr().err == (f"raydiff: error: --out {out}: {what}; the plot and the .csv beside it are "
                                       f"files: choose another name (python -m raydiff.lr_find --help)\n")
    assert [p.name for p in tmp_path.iterdir()] == [folder]


def test_lr_find_whose_numbers_cannot_be_written_leaves_no_new_plot_beside_an_earlier_run_s_numbers(
        tmp_path, monkeypatch, capsys):
    """The plot was published before its numbers were written: a .csv that failed (a full disk) left a new plot
    beside an earlier run's numbers, while the line said nothing half-written was left. Now the numbers are written
    first and published last, once the plot is."""
    import errno

    out = tmp_path / "lr.png"
    out.with_suffix(".csv").write_text("earlier\n")
    found = {"lrs": [1e-4, 1e-3], "losses": [1.0, 0.9], "smoothed": [1.0, 0.95], "suggested_lr": 1e-4,
             "steepest_lr": 1e-3, "minimum_lr": 1e-3, "steps_run": 2, "stop_reason": None}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lr_find, "run_lr_find", lambda cfg, **kwargs: found)
    monkeypatch.setattr(lr_find.csv, "writer", full_disk)
    assert cli.run(lr_find.main, ["--config", "smoke", "--out", str(out)]) == 2
    assert "no space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr.csv"] and out.with_suffix(".csv").read_text() == (
        "earlier\n")


@pytest.mark.ray
def test_lr_find_whose_first_loss_is_not_finite_says_so_in_one_line(tmp_path):
    """Weights of model.init_from that hold NaNs (or fp16 overflowing at once): nothing to suggest from (it was
    numpy's 'All-NaN slice encountered' traceback)."""
    import torch

    from raydiff.config import load_config
    from raydiff.model.unet import build_model
    from raydiff.runs.checkpoint import write_state

    cfg = load_config("smoke", check_source=False)
    weights = {k: torch.full_like(v, float("nan")) for k, v in build_model(cfg).state_dict().items()}
    folder = tmp_path / "broken" / "checkpoint_00000010"
    folder.mkdir(parents=True)
    write_state(folder, {"config": cfg.to_dict(), "model": weights, "ema": weights, "step": 10})
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", f"model.init_from={folder}", "--steps", "10",
                   "--out", str(tmp_path / "lr.png"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "raydiff: config error: lr_find: the loss was not finite at the first step (lr 1e-07): check "
        "train.precision (fp16 may overflow) and model.init_from's weights, or start lower with --start")
    assert not (tmp_path / "lr.png").exists()


@pytest.mark.ray
def test_lr_find_refuses_a_held_out_share_that_leaves_nothing_to_train_on(tmp_path):
    proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", "data.val_images=5000", "--steps", "10",
                   "--out", str(tmp_path / "lr.png"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "raydiff: error: data.val_images = 5000: must be below the number of usable images in data.source (1797)")
