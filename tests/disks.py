"""Small file systems of their own for the storage-failure tests: a tmpfs (needs root: the tests skip without it),
one that is full but for a few kilobytes, and another job that fills one while a command writes there; and what
reaches the disk, in order (`syncs_and_renames`), for the durability tests."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = "filler"  # the file that takes a full disk's room; removing it makes room


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A small file system of its own at `path` (a tmpfs: needs root), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def full_disk(path: Path, *, size: str = "4m", free_kb: int = 0) -> Iterator[Path]:
    """A tmpfs at `path` with about `free_kb` KB free: the rest is taken by the file FILLER."""
    with tmpfs(path, size) as disk:
        filler = disk / FILLER
        _take_the_room(filler)
        taken = filler.stat().st_size
        with filler.open("r+b") as f:
            f.truncate(max(taken - free_kb * 1024, 0))
        yield disk


def fill_leaving(disk: Path, free_bytes: int, *, name: str = "other-job") -> Path:
    """Another job's file `name` on `disk`, taking all its room but `free_bytes`, while the run under test writes
    there too: allocated at once (a write the run makes meanwhile cannot make it fail halfway), again if the run
    took room between the look and the allocation."""
    path = disk / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while (room := shutil.disk_usage(disk).free - free_bytes) > 0:
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size + room)
                break
            except OSError as exc:  # a tmpfs gives back what a failed allocation took
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def kept_full(disk: Path, *, once: Path | None = None) -> Iterator[None]:
    """Another job that takes whatever room appears on `disk`, within milliseconds, until the block ends (then its
    files, FILLER-<n>, go): every write from then on fails, whichever comes first. With `once`, from the moment
    that path exists (the write that made it succeeded: the next one fails)."""
    stop = threading.Event()

    def take_the_room() -> None:
        n = 0
        while not stop.wait(0.001):
            if (once is not None and not once.exists()) or os.statvfs(disk).f_bavail == 0:
                continue
            n += 1
            _take_the_room(disk / f"{FILLER}-{n}")

    thread = threading.Thread(target=take_the_room, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for filler in disk.glob(f"{FILLER}-*"):
            filler.unlink()


def _take_the_room(path: Path) -> None:
    """Write zeros to the new file `path` until the disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, bytes(65536)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def left_on(disk: Path) -> list[str]:
    """What a command left on a full disk: every file and folder but the fillers, hidden ones included."""
    return sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if not p.name.startswith(FILLER))


def syncs_and_renames(monkeypatch) -> list[tuple[str, str]]:
    """What reaches the disk, in order: ("fsync", the real path of the file or folder) and ("rename", the new
    path), for every fsync and rename the process makes from now on, from any thread."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recorded(move):
        def renamed(src, dst, **kwargs):
            move(src, dst, **kwargs)
            events.append(("rename", os.path.realpath(dst)))
        return renamed

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", recorded(real_replace))
    monkeypatch.setattr(os, "rename", recorded(real_rename))
    return events
