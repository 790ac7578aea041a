"""Ray's own temp directory on this machine (RAY_TMPDIR, else TMPDIR, else /tmp; then ray/), where a local Ray
instance keeps its session: its processes' logs and output, its sockets, the objects it spills.

Why raydiff looks at it: Ray does not say plainly when it is the problem. Full or read-only, a local instance
waits a minute for processes that cannot start and raises a traceback; too long a path, Ray's Unix sockets do not
fit and it raises another. Over Ray's capacity threshold (95% in use) Ray spills no objects there, and its raylet
says so every ten seconds; once full, the workers' output (the step lines) cannot reach the driver's terminal and
Ray's processes print a traceback for every log line they cannot write, while the run itself goes on. So: one line
before a local instance starts, one warning while it runs (`watch`), and the rest left out (`worker_output`).
"""

from __future__ import annotations

import os
import shutil
import threading

from ray._common.utils import get_default_ray_temp_dir

from raydiff.cluster.errors import RayCannotStart
from raydiff.cluster.worker_output import ray_disk_warned, raydiff_watches_ray_disk, warn_ray_disk_once
from raydiff.storage.errors import disk_usage, megabytes, nearest_existing

# A local instance's session when it starts (its logs, sockets, runtime files), with room for its logs: with less
# free, Ray's processes cannot start (Ray waits for them, then raises).
SESSION_BYTES = 8 * 2**20
WATCH_EVERY_S = 5.0
UNIX_SOCKET_PATH_BYTES = 107  # Linux's limit, which Ray checks its socket paths against
FIX = "free space there, or set RAY_TMPDIR to a folder on a disk with room"
# The fraction of a disk in use over which Ray spills no objects to it, and its default (Ray's
# `local_fs_capacity_threshold`, read from the environment by every Ray process).
CAPACITY_THRESHOLD_VARIABLE, RAY_CAPACITY_THRESHOLD = "RAY_local_fs_capacity_threshold", 0.95


def check_before_start() -> str:
    """Ray's temp directory, checked to hold a local instance's session (one line where it cannot: RayCannotStart),
    with a warning where it is over Ray's capacity threshold."""
    temp = get_default_ray_temp_dir()
    usage = disk_usage(temp)
    if usage is None:
        return temp
    existing = nearest_existing(temp)
    if not existing.is_dir():  # TMPDIR naming a file: Ray's NotADirectoryError
        raise RayCannotStart(f"cannot start a local Ray instance: its temp directory {temp} would be under {existing}, "
                             f"which is a file, not a folder; set RAY_TMPDIR (or TMPDIR) to a folder")
    if not os.access(existing, os.W_OK):
        raise RayCannotStart(f"cannot start a local Ray instance: its temp directory {temp} is not writable; make it "
                             f"writable, or set RAY_TMPDIR to a writable folder")
    if usage.free < SESSION_BYTES:
        raise RayCannotStart(f"cannot start a local Ray instance: its temp directory {temp} has "
                             f"{megabytes(usage.free)} free, and Ray's session there needs {megabytes(SESSION_BYTES)}; "
                             f"{FIX}")
    _warn_if_over_threshold(temp, usage)
    return temp


def too_long(temp: str) -> RayCannotStart:
    """The error for Ray's refusal of its socket paths under `temp`."""
    return RayCannotStart(f"cannot start a local Ray instance: its temp directory {temp} is too long a path for the "
                          f"Unix sockets Ray makes under it (at most {UNIX_SOCKET_PATH_BYTES} bytes each); set "
                          f"RAY_TMPDIR to a shorter one")


def watch(temp: str) -> threading.Event:
    """Look at `temp` every WATCH_EVERY_S seconds, on a daemon thread, and warn once when it goes over Ray's capacity
    threshold (a disk another job fills is not the run's failure), until the warning is given or the event returned
    is set. The raylet's own lines about it are left out from now on: the warning says it."""
    stop = threading.Event()
    raydiff_watches_ray_disk()

    def look() -> None:
        while not ray_disk_warned() and not stop.wait(WATCH_EVERY_S):
            _warn_if_over_threshold(temp, disk_usage(temp))

    threading.Thread(target=look, name="raydiff-ray-temp-dir", daemon=True).start()
    return stop


def _capacity_threshold() -> float:
    """Ray's capacity threshold for this machine's Ray processes (`CAPACITY_THRESHOLD_VARIABLE`, else Ray's)."""
    try:
        return float(os.environ.get(CAPACITY_THRESHOLD_VARIABLE, RAY_CAPACITY_THRESHOLD))
    except ValueError:
        return RAY_CAPACITY_THRESHOLD


def _warn_if_over_threshold(temp: str, usage: shutil._ntuple_diskusage | None) -> None:
    threshold = _capacity_threshold()
    if usage is None or not usage.total or (in_use := (usage.total - usage.free) / usage.total) < threshold:
        return
    warn_ray_disk_once(f"[raydiff] warning: Ray's temp directory {temp} is {in_use:.0%} full "
                       f"({megabytes(usage.free)} free): over {threshold:.0%} Ray spills no objects there (work that "
                       f"would spill fails), and once it is full Ray's logs and the workers' lines on this terminal "
                       f"stop (the run goes on, its metrics in its run directory); {FIX}")
