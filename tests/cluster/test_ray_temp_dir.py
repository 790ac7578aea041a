"""Ray's own temp directory (RAY_TMPDIR, else TMPDIR, else /tmp), where a local Ray instance keeps its session: its
logs, sockets and spilled objects. Full or read-only, it is one line before anything starts (Ray itself waits a
minute, then raises a traceback); over Ray's capacity threshold it is one warning, not the raylet's line every ten
seconds; filled during a run, the run goes on, without the tracebacks of Ray's processes that cannot write their
logs."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from conftest import run_cli, run_cli_acting
from disks import fill_leaving, kept_full, tmpfs

from raydiff.cluster.ray_temp_dir import CAPACITY_THRESHOLD_VARIABLE, RAY_CAPACITY_THRESHOLD

SMOKE = ["--config", "smoke", "--set", "scaling.num_workers=1", "--set", "train.sample_every=0"]


def local_instance(temp: Path) -> dict[str, str]:
    """The environment of a command that starts a local Ray instance with its temp directory in `temp`, and Ray's
    default capacity threshold (the other tests set their own: tests/conftest.py)."""
    return {"RAY_ADDRESS": "local", "RAY_TMPDIR": str(temp), CAPACITY_THRESHOLD_VARIABLE: str(RAY_CAPACITY_THRESHOLD)}


COMMANDS = {"train": ["raydiff.train", *SMOKE],
            "tune": ["raydiff.tune", "--config", "smoke", "--lr", "1e-4:1e-3", "--batch", "16", "--samples", "2",
                     "--name", "smoke", "--set", "train.warmup_steps=1",  # warmup and EMA within the comparisons:
                     "--set", "train.ema_decay=0.5", "--set", "train.ema_warmup_steps=0"]}  # no warning


@pytest.mark.parametrize("command, state", [("train", "full"), ("train", "read-only"), ("tune", "full")])
def test_a_local_ray_instance_without_room_for_its_temp_directory_is_one_line_before_anything_starts(
        tmp_path, short_path, command, state):
    with tmpfs(short_path, "4m", read_only=state == "read-only") as temp:
        if state == "full":
            fill_leaving(temp, 0)
        proc = run_cli(*COMMANDS[command], "--set", f"run.storage={tmp_path / 'runs'}",
                       env=local_instance(temp), timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    expected = "has 0.0 MB free" if state == "full" else "is not writable"
    assert proc.stderr.startswith(f"raydiff: error: cannot start a local Ray instance: its temp directory "
                                  f"{temp / 'ray'} {expected}") and "RAY_TMPDIR" in proc.stderr
    assert not (tmp_path / "runs" / "smoke").exists()


def test_a_ray_temp_directory_under_a_file_is_one_line(tmp_path):
    """TMPDIR naming a file (a mistyped variable): Ray's NotADirectoryError traceback otherwise."""
    (tmp_path / "afile").write_text("")
    proc = run_cli("raydiff.train", *SMOKE, "--set", f"run.storage={tmp_path / 'runs'}",
                   env=local_instance(tmp_path / "afile"), timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith(f"raydiff: error: cannot start a local Ray instance: its temp directory "
                                  f"{tmp_path / 'afile' / 'ray'} would be under {tmp_path / 'afile'}, which is a file, "
                                  f"not a folder; set RAY_TMPDIR")
    assert not (tmp_path / "runs" / "smoke").exists()


def test_a_ray_temp_directory_too_long_for_ray_s_sockets_is_one_line(tmp_path):
    """A Unix socket's path holds at most 107 bytes; Ray's are its temp directory and about 60 more."""
    temp = tmp_path / ("long" * 10)
    proc = run_cli("raydiff.train", *SMOKE, "--set", f"run.storage={tmp_path / 'runs'}",
                   env=local_instance(temp), timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith(f"raydiff: error: cannot start a local Ray instance: its temp directory "
                                  f"{temp / 'ray'} is too long a path for ") and "RAY_TMPDIR" in proc.stderr
    assert not (tmp_path / "runs" / "smoke").exists()


@pytest.mark.ray
def test_a_ray_temp_directory_over_ray_s_capacity_threshold_is_one_warning_and_the_run_trains(tmp_path, short_path):
    """Over 95% full, Ray will not spill objects there, and its raylet says so every ten seconds."""
    with tmpfs(short_path, "256m") as temp:
        fill_leaving(temp, 12 * 2**20)
        proc = run_cli("raydiff.train", *SMOKE, "--set", "train.total_steps=40", "--set",
                       f"run.storage={tmp_path / 'runs'}", env=local_instance(temp))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    [warning] = [line for line in output.splitlines() if "Ray's temp directory" in line]
    assert warning.startswith(f"[raydiff] warning: Ray's temp directory {temp / 'ray'} is 95% full (")
    assert "file_system_monitor" not in output, output[-3000:]
    assert json.loads((tmp_path / "runs" / "smoke" / "summary.json").read_text())["status"] == "finished"


@pytest.mark.ray
def test_a_ray_temp_directory_that_fills_during_a_run_leaves_the_run_going_without_ray_s_tracebacks(tmp_path,
                                                                                                   short_path):
    """Ray's processes then cannot write their logs: Python's logging reports each failed write with a traceback,
    Ray's C++ logger in a line of its own, and the raylet says the disk is full every ten seconds. The run trains
    for at least 15 s after the disk fills (100 steps of at least 0.15 s) on any host: time, not steps, is what it
    must outlast, and steps are what a busy host makes slow."""
    with tmpfs(short_path, "256m") as temp, contextlib.ExitStack() as filling:
        code, output = run_cli_acting("raydiff.train", *SMOKE, "--set", "train.total_steps=100", "--set",
                                      "debug.step_delay_s=0.15", "--set",
                                      f"run.storage={tmp_path / 'runs'}", at="[raydiff] starting",
                                      act=lambda _: filling.enter_context(kept_full(temp)),
                                      env=local_instance(temp))
    assert code == 0, output[-3000:]
    assert "Traceback" not in output and "Logging error" not in output, output[-5000:]
    [warning] = [line for line in output.splitlines() if "Ray's temp directory" in line]
    assert warning.startswith(f"[raydiff] warning: Ray's temp directory {temp / 'ray'} is 100% full (0.0 MB free)")
    # Ray's C++ logger says so in this process too, where no filter reaches: two lines at most, no traceback.
    assert not any("LOG ERROR" in line for line in output.splitlines() if "pid=" in line), output[-5000:]
    assert "file_system_monitor" not in output, output[-5000:]
    assert json.loads((tmp_path / "runs" / "smoke" / "summary.json").read_text())["status"] == "finished"
