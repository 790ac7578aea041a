"""Local files and folders that appear whole or not at all, appends that add whole lines or nothing, and scratch
folders that a killed process does not leave behind for good.

Why: a command that fails mid-write (a full disk, a quota, a stop) must leave neither a file that a reader takes
for complete nor a hidden partial one that keeps the disk full and blocks the next try; and a JSON-lines log cut
in the middle of a row would make the run directory unreadable at its next start. A file or folder is written
beside its target under a hidden name and renamed into place (atomic within one file system); an append that
fails is cut back to where it began. A process killed outright (the OOM killer, SIGKILL) cannot remove its
scratch folder, and a checkpoint staged there is the size of the whole training state: the next one of its kind
removes it.

A rename is atomic, not durable: ext4 (delayed allocation) and XFS may write the new name to disk before the
bytes, so a power loss would leave an empty file under the final name, after the old copies were pruned. What is
renamed into place is fsynced first, and its folder after; nothing else is (a scratch copy needs no fsync). A
folder is made as any new folder is (0o777 less the umask), not mkdtemp's 0o700, which the rename would keep and
which would shut other users and pods of a shared mount out of an exported pipeline or prepared data.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TAIL_CHUNK = 1 << 16  # bytes read at a time when looking back for a log's last whole line
STALE_SCRATCH_S = 600  # a scratch folder of a process that is gone is removed once it is this old


@contextmanager
def new_file(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """A hidden path beside `path` to write: renamed onto `path` when the block ends, removed if the block fails.
    The parent folder is made if missing. `durable`: the bytes are on disk before the rename and the name after,
    so that a power loss leaves the old file or the new one (False for a scratch copy, or a file inside a folder
    whose own publication syncs it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # `is_new_file_tmp`
    try:
        yield tmp
        if durable:
            sync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_folder(path.parent)


def is_new_file_tmp(name: str) -> bool:
    """Whether a file name is one `new_file` writes under (what a process killed mid-write leaves)."""
    return re.fullmatch(r"\..+\.[0-9a-f]{8}\.tmp", name) is not None


@contextmanager
def new_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A hidden empty folder beside `path` to fill: renamed onto `path` (absent, or an empty folder) when the block
    ends, on disk with all it holds before the rename (`publish_folder`); removed with all it holds if the block
    fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_folder(path, ".")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_folder(tmp, path)


def hidden_folder(path: Path, separator: str) -> Path:
    """A new empty folder `.<name><separator><host>-<pid>-<random>` beside `path` (whose parent exists), with the
    mode of any new folder (0o777 less the umask; mkdtemp's 0o700 would stay on it after the rename), after
    removing those that a process of this host now gone left there (killed outright, as `scratch_folder`'s: a
    prepared dataset's copy is the size of the dataset). Another host's are left: its processes are not seen."""
    host = socket.gethostname()
    prefix = f".{path.name}{separator}{host}-"
    ours = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]{8}")  # not host gpu-2's beside gpu's, nor out-2's
    for stale in path.parent.glob(f"{glob.escape(prefix)}*-*"):
        mine = ours.fullmatch(stale.name)
        try:
            old = time.time() - stale.stat().st_mtime > STALE_SCRATCH_S
        except OSError:  # removed meanwhile
            continue
        if mine and old and not process_runs(int(mine.group(1))):
            shutil.rmtree(stale, ignore_errors=True)
    for _ in range(100):
        folder = path.with_name(f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(errno.EEXIST, "no free hidden name for a new folder", str(path))


def publish_folder(tmp: Path, path: Path) -> None:
    """Rename the filled folder `tmp` onto `path` (absent, or an empty folder), durably: its files and folders are
    on disk before the rename, the new name after. `tmp` is removed if that fails."""
    try:
        sync_tree(tmp)
        os.replace(tmp, path)  # onto an empty folder too (rename(2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_folder(path.parent)


def sync_file(path: str | os.PathLike) -> None:
    """The bytes of a local file on disk (fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: str | os.PathLike) -> None:
    """A local folder's entries (a name just renamed into it) on disk; a no-op on a file system that cannot
    fsync a folder (some FUSE and SMB mounts)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def sync_tree(folder: str | os.PathLike) -> None:
    """Every file and folder in a local folder, and the folder itself, on disk: what a rename will publish."""
    for root, _, files in os.walk(os.fspath(folder), topdown=False):  # the folder itself last
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                sync_file(file)
        sync_folder(root)


def append_lines(path: str | os.PathLike, text: str) -> None:
    """Append whole lines (`text` ends in a newline) to `path`, made if missing: all of them or none. A failed
    write is cut back off; a last line that an earlier crash left without its newline is dropped first. Under an
    exclusive lock of the file (where its file system has locks): another process appending (two evaluations of
    one run) neither loses its row to this one's cut nor has its line cut half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released as the file is closed
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size = _after_last_newline(fd, size)
            os.ftruncate(fd, size)
        rest = memoryview(text.encode())
        try:
            while rest:
                rest = rest[os.write(fd, rest):]
        except BaseException:
            os.ftruncate(fd, size)  # frees what the failed write took: works on a full disk
            raise
    finally:
        os.close(fd)


def scratch_folder(kind: str) -> Path:
    """A new folder `raydiff-<kind>-<pid>-*` in the temporary folder, after removing those of `kind` that a process
    now gone left (older than STALE_SCRATCH_S, in case the process is one of another pid namespace sharing it).
    `kind` has no "-"."""
    root = Path(tempfile.gettempdir())
    for stale in root.glob(f"raydiff-{kind}-*-*"):
        pid = stale.name.split("-")[2]
        try:
            old = time.time() - stale.stat().st_mtime > STALE_SCRATCH_S
        except OSError:  # removed meanwhile
            continue
        if pid.isdigit() and old and not process_runs(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"raydiff-{kind}-{os.getpid()}-"))


def process_runs(pid: int) -> bool:
    """Whether the process `pid` of this machine runs (a zombie, ended but not yet reaped, does not)."""
    if pid <= 0:  # no process (0 and -1 would signal a whole process group)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): it answered the signal
        return True


def whole_lines(text: str) -> list[str]:
    """The lines of a log that `append_lines` writes, without a last one cut short by a crash (no newline)."""
    lines = text.split("\n")
    return lines[:-1]  # the part after the last newline: "" for a whole file, a cut line otherwise


def _after_last_newline(fd: int, size: int) -> int:
    end = size
    while end > 0:
        start = max(0, end - TAIL_CHUNK)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0
