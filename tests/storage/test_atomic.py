"""Local files and folders appear whole or not at all, and a log gains whole rows or none: a write that fails
(a full disk, a stop) leaves neither a partial file in sight nor a hidden one taking room, and a log cut mid-row by
a crash still reads; what is renamed into place is on disk first (a power loss leaves no empty file), and a new
folder is as readable by others as any new folder."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from disks import full_disk, left_on, syncs_and_renames

from raydiff.runs.runlog import JsonlLog
from raydiff.storage.atomic import append_lines, new_file, new_folder, scratch_folder
from raydiff.storage.rundir import RunDir


def test_a_file_that_fails_midway_leaves_the_old_one_and_nothing_else(tmp_path):
    target = tmp_path / "grid.png"
    target.write_bytes(b"old")
    with pytest.raises(OSError), new_file(target) as tmp:
        tmp.write_bytes(b"half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]
    with new_file(tmp_path / "sub" / "grid.png") as tmp:
        tmp.write_bytes(b"new")
    assert (tmp_path / "sub" / "grid.png").read_bytes() == b"new" and len(list((tmp_path / "sub").iterdir())) == 1


def test_a_folder_appears_whole_onto_an_empty_one_or_not_at_all(tmp_path):
    with pytest.raises(KeyboardInterrupt), new_folder(tmp_path / "pipeline") as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "weights").write_bytes(b"half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "pipeline").mkdir()  # an empty folder the user made for it
    with new_folder(tmp_path / "pipeline") as tmp:
        (tmp / "model_index.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["pipeline"]
    assert [p.name for p in (tmp_path / "pipeline").iterdir()] == ["model_index.json"]


def test_on_a_full_disk_a_new_file_takes_no_room_and_a_log_gains_no_half_row(tmp_path):
    with full_disk(tmp_path / "disk", free_kb=8) as disk:
        with pytest.raises(OSError) as failed, new_file(disk / "samples.png") as tmp:
            tmp.write_bytes(b"x" * 64 * 1024)
        assert failed.value.errno == errno.ENOSPC and left_on(disk) == []
        log = JsonlLog(RunDir(disk), "metrics.jsonl")
        rows = 0
        with pytest.raises(OSError) as failed:
            while True:  # rows of 100 bytes, until one does not fit: most cross a page boundary first
                log.append({"step": rows, "pad": "x" * 80})
                rows += 1
        assert failed.value.errno == errno.ENOSPC and rows > 10
        text = (disk / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [r["step"] for r in log.rows()] == list(range(rows))


def test_a_row_cut_by_a_crash_is_not_read_and_the_next_append_drops_it(tmp_path):
    log_file = tmp_path / "events.jsonl"
    log_file.write_text(json.dumps({"step": 10}) + "\n" + '{"step": 2')  # a crash mid-write
    log = JsonlLog(RunDir(tmp_path), "events.jsonl")
    assert log.rows() == [{"step": 10}]
    log.append({"step": 20})
    assert log_file.read_text() == '{"step": 10}\n{"step": 20}\n'
    append_lines(tmp_path / "one.jsonl", "{}\n")
    (tmp_path / "one.jsonl").write_text("{")  # cut with no whole line before it
    append_lines(tmp_path / "one.jsonl", "[]\n")
    assert (tmp_path / "one.jsonl").read_text() == "[]\n"


_APPEND_THAT_FAILS = """
import errno, os, sys, time
from raydiff.storage import atomic
def write(fd, data):  # the disk fills during this row, after a moment
    open(sys.argv[2], "w").close()
    time.sleep(1.0)
    raise OSError(errno.ENOSPC, "No space left on device")
atomic.os.write = write
try:
    atomic.append_lines(sys.argv[1], '{"row": "A"}\\n')
except OSError:
    pass
"""


def test_a_row_appended_while_another_process_append_fails_is_kept(tmp_path):
    """Two evaluations of one run append to its eval.jsonl: a failed append is cut back to the size it found, which
    erased the row the other appended meanwhile. The appends take turns now."""
    log, started = tmp_path / "eval.jsonl", tmp_path / "started"
    append_lines(log, '{"row": "old"}\n')
    other = subprocess.Popen([sys.executable, "-c", _APPEND_THAT_FAILS, str(log), str(started)])
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    append_lines(log, '{"row": "B"}\n')
    assert other.wait(timeout=60) == 0
    assert log.read_text().splitlines() == ['{"row": "old"}', '{"row": "B"}']


def test_the_scratch_folder_of_a_killed_process_is_removed_by_the_next_of_its_kind(tmp_path, monkeypatch):
    """A worker killed outright (the OOM killer) leaves its staged checkpoint, the size of the training state."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    an_hour_ago = time.time() - 3600

    def folder(name: str, *, old: bool = True):
        path = tmp_path / name
        path.mkdir()
        (path / "state.pt").write_bytes(b"state")
        if old:
            os.utime(path, (an_hour_ago, an_hour_ago))
        return path

    killed = folder(f"raydiff-ckpt-{gone}-a1b2")
    just_made = folder(f"raydiff-ckpt-{gone}-c3d4", old=False)  # maybe a live process of another pid namespace
    alive = folder(f"raydiff-ckpt-{os.getpid()}-e5f6")
    other_kind = folder(f"raydiff-tensorboard-{gone}-g7h8")
    new = scratch_folder("ckpt")
    assert new.parent == tmp_path and new.name.startswith(f"raydiff-ckpt-{os.getpid()}-") and new.is_dir()
    assert not killed.exists() and just_made.exists() and alive.exists() and other_kind.exists()


def test_a_new_file_is_on_disk_before_it_takes_its_name_and_its_name_after(tmp_path, monkeypatch):
    """ext4 (delayed allocation) and XFS may write a rename before the bytes: a power loss would leave an empty
    file under the final name."""
    events = syncs_and_renames(monkeypatch)
    target = tmp_path / "state.pt"
    with new_file(target) as tmp:
        tmp.write_bytes(b"state")
    folder = os.path.realpath(tmp_path)
    assert events == [("fsync", os.path.realpath(tmp)), ("rename", os.path.realpath(target)), ("fsync", folder)]
    events.clear()
    with new_file(tmp_path / "scratch.pt", durable=False) as tmp:
        tmp.write_bytes(b"scratch")
    assert [kind for kind, _ in events] == ["rename"]  # a scratch copy: no fsync


def test_a_new_folder_and_all_it_holds_are_on_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    events = syncs_and_renames(monkeypatch)
    with new_folder(tmp_path / "pipeline") as tmp:
        (tmp / "unet").mkdir()
        (tmp / "unet" / "weights").write_bytes(b"weights")
        (tmp / "model_index.json").write_text("{}")
    renamed = events.index(("rename", os.path.realpath(tmp_path / "pipeline")))
    synced = {path for kind, path in events[:renamed] if kind == "fsync"}
    assert synced == {os.path.realpath(p) for p in (tmp, tmp / "unet", tmp / "unet" / "weights",
                                                     tmp / "model_index.json")}
    assert events[renamed + 1:] == [("fsync", os.path.realpath(tmp_path))]  # its name, and nothing else


def test_a_new_folder_is_as_readable_by_others_as_any_new_folder(tmp_path):
    """mkdtemp's 0o700 would stay on the folder after the rename and shut other users and pods of a shared mount
    out of an exported pipeline or the built-in data."""
    umask = os.umask(0o022)
    try:
        with new_folder(tmp_path / "pipeline") as tmp:
            (tmp / "model_index.json").write_text("{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "pipeline").stat().st_mode) == 0o755


def test_a_hidden_folder_that_a_killed_process_of_this_host_left_is_removed_by_the_next(tmp_path):
    """A prepare (or an export) killed outright leaves its hidden copy beside OUT, the size of the dataset: the next
    hidden folder made there removes it, once old. A live process's, a fresh one, and another host's stay."""
    import socket

    from raydiff.storage.atomic import STALE_SCRATCH_S, hidden_folder

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host, out = socket.gethostname(), tmp_path / "out"
    left = {"killed": tmp_path / f".out-{host}-{gone.pid}-0badc0de", "live": tmp_path / f".out-{host}-{os.getpid()}-0",
            "fresh": tmp_path / f".out-{host}-{gone.pid}-1", "elsewhere": tmp_path / f".out-other-host-{gone.pid}-2",
            "host-2": tmp_path / f".out-{host}-2-{gone.pid}-0badc0de"}  # host "<ours>-2": another machine
    long_ago = time.time() - STALE_SCRATCH_S - 60
    for name, folder in left.items():
        folder.mkdir()
        if name != "fresh":
            os.utime(folder, (long_ago, long_ago))
    made = hidden_folder(out, "-")
    assert made.is_dir() and made.name.startswith(f".out-{host}-{os.getpid()}-")
    assert {name for name, folder in left.items() if folder.exists()} == {"live", "fresh", "elsewhere", "host-2"}
