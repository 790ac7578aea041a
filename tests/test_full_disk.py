"""Every command's output on a full disk, through the commands: one line naming what failed, why, the room left and
what to do, exit 2, and nothing half-written left there (no partial file, no hidden one taking room); once there
is room, the same command writes it whole. An evaluation's result is in its line, so its minutes are not lost."""

from __future__ import annotations

import pytest
from conftest import run_cli, write_posthoc_run
from disks import FILLER, full_disk, left_on, tmpfs
from test_export import write_checkpoint

from raydiff import cli, datasets, ema, export, sample
from raydiff.config import load_config
from raydiff.evaluate import main as evaluate_main

FULL = "writing it failed: no space left on device (0.0 MB free); nothing half-written was left there; free space " \
       "there or set another"


def _error_line(output: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("raydiff:")]
    return line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run's checkpoint as training writes it (random weights, no Ray)."""
    run = tmp_path_factory.mktemp("full-disk") / "run"
    write_checkpoint(run, load_config("smoke", ["diffusion.timesteps=50"], check_source=False))
    return run


@pytest.mark.parametrize("out", ["grid.png", "folder"])
def test_sample_on_a_full_disk_writes_nothing_then_all_once_there_is_room(run_dir, tmp_path, capsys, out):
    with full_disk(tmp_path / "disk") as disk:
        args = ["--checkpoint", str(run_dir), "--num", "16", "--sampler", "ddim", "--steps", "2",
                "--out", str(disk / out)]
        assert cli.run(sample.main, args) == 2
        assert _error_line(capsys.readouterr().err) == f"raydiff: error: --out {disk / out}: {FULL} --out"
        assert left_on(disk) == ([] if out.endswith(".png") else [out])  # the folder asked for, empty
        (disk / FILLER).unlink()
        assert cli.run(sample.main, args) == 0
        expected = [out] if out.endswith(".png") else \
            [out, f"{out}/grid.png", *(f"{out}/sample_{i:05d}.png" for i in range(16))]
        assert left_on(disk) == sorted(expected)


def test_export_on_a_full_disk_leaves_no_part_of_the_pipeline(run_dir, tmp_path, capsys):
    with full_disk(tmp_path / "disk") as disk:
        args = ["--checkpoint", str(run_dir), "--out", str(disk / "pipeline")]
        assert cli.run(export.main, args) == 2  # safetensors says it in its own error type
        assert _error_line(capsys.readouterr().err) == f"raydiff: error: --out {disk / 'pipeline'}: {FULL} --out"
        assert left_on(disk) == []
        (disk / FILLER).unlink()
        assert cli.run(export.main, args) == 0
        assert "pipeline/model_index.json" in left_on(disk)


def test_rebuilt_averages_on_a_full_disk_leave_no_partial_checkpoint(tmp_path, capsys):
    write_posthoc_run(tmp_path / "run")
    with full_disk(tmp_path / "disk") as disk:
        args = ["--checkpoint", str(tmp_path / "run"), "--sigma-rel", "0.05,0.1", "--out", str(disk / "ema")]
        assert cli.run(ema.main, args) == 2
        assert _error_line(capsys.readouterr().err) == f"raydiff: error: --out {disk / 'ema'}: {FULL} --out"
        assert left_on(disk) == ["ema"]  # the folder asked for, empty: a re-run is not refused
        (disk / FILLER).unlink()
        assert cli.run(ema.main, args) == 0
        assert left_on(disk) == ["ema", "ema/sigma_rel-0.050", "ema/sigma_rel-0.050/state.pt",
                                 "ema/sigma_rel-0.100", "ema/sigma_rel-0.100/state.pt"]


@pytest.mark.ray
def test_an_evaluation_whose_result_cannot_be_written_says_the_result(ray_session, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "8m") as disk:
        write_checkpoint(disk / "run", load_config("smoke", ["diffusion.timesteps=50"], check_source=False))
        with open(disk / FILLER, "wb") as f:  # then the disk fills (another job's files)
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        before = left_on(disk)
        args = ["--checkpoint", str(disk / "run"), "--num", "16", "--sampler", "ddim", "--steps", "2"]
        assert cli.run(evaluate_main, args) == 2
        err = capsys.readouterr().err
        # The reference statistics are a cache: not keeping them costs the next evaluation their time, no more.
        assert ("[raydiff] note: the reference statistics of builtin:digits at 8px were not kept in "
                f"{disk / '.raydiff-reference'} (no space left on device); they are computed again next time") in err
        line = _error_line(err)
        assert line.startswith(f"raydiff: error: --checkpoint {disk / 'run'}: writing the result into {disk / 'run'} "
                               f"failed: no space left on device; nothing half-written was left there. The result, "
                               f"not saved: step 20, 16 images (ddim, 2 steps, seed 0): digits_fd ")
        assert not [name for name in left_on(disk) if name not in before and (disk / name).is_file()]


@pytest.mark.ray
def test_lr_find_and_prepare_on_a_full_disk_are_one_line_each(tmp_path):
    with full_disk(tmp_path / "disk") as disk:
        found = run_cli("raydiff.lr_find", "--config", "smoke", "--steps", "10", "--out", str(disk / "lr.png"))
        assert found.returncode == 2, found.stderr[-3000:]
        assert _error_line(found.stderr) == f"raydiff: error: --out {disk / 'lr.png'}: {FULL} --out"
        prepared = run_cli("raydiff.prepare", "builtin:digits", str(disk / "prepared"), "--resolution", "8",
                           "--channels", "1")
        assert prepared.returncode == 2, prepared.stderr[-3000:]
        assert _error_line(prepared.stderr) == f"raydiff: error: OUT {disk / 'prepared'}: {FULL} OUT"
        assert "Traceback" not in found.stderr + prepared.stderr
        assert left_on(disk) == []


def test_the_built_in_datasets_on_a_full_disk_say_where_and_what_to_do(tmp_path, monkeypatch, capsys):
    with full_disk(tmp_path / "disk", size="16m") as disk:  # 1,797 small files: a page each once there is room
        monkeypatch.setenv("RAYDIFF_CACHE", str(disk / "cache"))
        assert cli.run(datasets.main, ["digits"]) == 2
        assert _error_line(capsys.readouterr().err) == (
            f"raydiff: error: cannot write the built-in dataset into {disk / 'cache'} (no space left on device); make "
            f"room there or set RAYDIFF_CACHE to another folder")
        assert cli.run(datasets.main, ["synthetic", str(disk / "synthetic"), "--num", "8"]) == 2
        assert _error_line(capsys.readouterr().err) == f"raydiff: error: OUT {disk / 'synthetic'}: {FULL} OUT"
        assert left_on(disk) == ["cache"]  # the cache folder, empty
        (disk / FILLER).unlink()
        assert cli.run(datasets.main, ["digits"]) == 0
        assert len(list((disk / "cache" / "digits-v1").iterdir())) == 1797
