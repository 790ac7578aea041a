"""What Ray forwards from its processes to the driver's terminal, filtered: a newcomer reads every error line as a
failure, and a traceback as a bug.

Ray prints its workers' and actors' output, and its raylets' error lines, on the driver's terminal. Some of it is
routine in runs that succeed (`HARMLESS_WORKER_LINES`, and a command's own `drop_worker_lines`); some says, as a
traceback or a line repeated every few seconds, what raydiff says in one line (a storage error no retry can fix,
met by Ray Train's controller; the workers waiting for room on a busy or growing cluster; Ray's own temp directory
full: `raydiff.cluster.ray_temp_dir`). Each filter matches what it leaves out exactly, so every other line, real
errors included, still reaches the terminal.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

from raydiff.storage.errors import FULL, permanent_reason_in

# Error-level lines that Ray's own processes print in runs that succeed. Each pattern matches one known message
# exactly, so every other line, real errors included, still reaches the driver's terminal.
HARMLESS_WORKER_LINES = (
    # Ray Train's controller starts its PreemptionWatcher with worker handles as arguments and max_restarts=-1;
    # Ray's core worker warns, at error level, that a restart could lose them (ray-project/ray#53727).
    re.compile(r"class name: 'PreemptionWatcher' .* has constructor arguments in the object store and "
               r"max_restarts > 0"),
)
# Ray Train's placement-group cleaner on a cluster without the dashboard, every second or two for a whole run:
# said once by raydiff (`raydiff.cluster.start.warn_without_dashboard`), which then drops it.
NO_STATE_API = re.compile(r"Failed to query Ray Train Controller actor state\. State API may be temporarily "
                          r"unavailable\.")
_INSTALLED_FILTERS: list[Callable[[dict[str, Any]], None]] = []  # installed once per process, not stacked
_ROUTINE_HERE: list[re.Pattern] = []  # lines routine in this process's command only (`drop_worker_lines`)
# Ray Train's controller logs the traceback of any error in its control loop. Two it meets are said in one line
# instead: a storage error no retry can fix (its own checkpoint list written to a full disk), which fails the run and
# the driver says; and its workers finding no room on the cluster within Ray Train's start timeout (60 s unless
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), after which Ray Train tries again for as long as it takes: on a cluster
# busy with other jobs, or whose autoscaler is still adding nodes, a traceback a minute. Any other error keeps its
# traceback.
_CONTROLLER_ERROR = re.compile(r"Error in control loop iteration: (.*)")
_NO_ROOM = re.compile(r"The worker group startup timed out after ([\d.]+) seconds waiting for (\d+) workers")


class _ControllerTracebacks:
    """Per process, a controller's "Error in control loop iteration" block (the line, then its traceback up to and
    including the exception's own line) for what raydiff says in one line: nothing for a storage error no retry can
    fix, a line saying that the run waits for room for its workers where they found none."""

    def __init__(self) -> None:
        self._in_block: set[Any] = set()  # the pids whose block is being left out
        self._waited_s: dict[Any, float] = {}  # per controller: how long its workers have waited for room

    def shown(self, pid: Any, line: str) -> list[str]:
        """The lines to show for `line`, the next of process `pid`."""
        if pid in self._in_block:
            in_traceback = line.startswith(("Traceback", " ")) or not line.strip()
            if not in_traceback:
                self._in_block.discard(pid)  # the exception's line ends the block
            return []
        error = _CONTROLLER_ERROR.search(line)
        if error is None:
            return [line]
        no_room = _NO_ROOM.search(error.group(1))
        if no_room is not None:
            self._in_block.add(pid)
            return [self._waiting(pid, float(no_room.group(1)), int(no_room.group(2)))]
        if permanent_reason_in(error.group(1)) is not None:
            self._in_block.add(pid)
            return []
        return [line]

    def _waiting(self, pid: Any, timeout_s: float, workers: int) -> str:
        waited_s = self._waited_s[pid] = self._waited_s.get(pid, 0.0) + timeout_s
        what = f"{workers} worker{'s' if workers != 1 else ''}"
        if waited_s > timeout_s:
            return f"[raydiff] still waiting for room on the cluster for {what}: {waited_s:.0f} s so far"
        return (f"[raydiff] waiting for room on the cluster for {what}: none for {timeout_s:.0f} s (its resources are "
                f"in use, or nodes are still being added); Ray Train tries again until there is")


# Over Ray's capacity threshold, a raylet says its temp directory is full every ten seconds for as long as it lasts:
# said once, by raydiff (`warn_ray_disk_once`, where it watches the disk: a local instance's) or by the first such
# line (a joined cluster's node).
_RAY_DISK_OVER = re.compile(r"file_system_monitor\.cc:\d+: .* is over \d+% full")
_RAY_DISK_SAID = threading.Event()
_RAY_DISK_WATCHED = threading.Event()
_SAYING = threading.Lock()  # the watch on Ray's temp directory says it from a thread of its own
# Ray's C++ logger, failing to write a process's log file, says so on its terminal.
_LOG_WRITE_FAILED = re.compile(r"^\[\*\*\* LOG ERROR #\d+ \*\*\*\]")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception): ")  # a traceback's last line


def warn_ray_disk_once(line: str) -> None:
    """Print raydiff's `line` saying that Ray's temp directory is over Ray's capacity threshold, unless this process
    has said it (or let the raylet's own line through); the raylet's lines are left out from then on."""
    if _first_to_say():
        print(line, flush=True)


def _first_to_say() -> bool:
    """Marks Ray's full temp directory as said; whether it was not said before (by raydiff or the raylet's line)."""
    with _SAYING:
        said = _RAY_DISK_SAID.is_set()
        _RAY_DISK_SAID.set()
    return not said


def raydiff_watches_ray_disk() -> None:
    """This process watches Ray's temp directory and will say it when it is over the threshold: the raylet's lines
    are left out, the first included (which of the two comes first is a race)."""
    _RAY_DISK_WATCHED.set()


def ray_disk_warned() -> bool:
    """Whether this process has said that Ray's temp directory is over Ray's capacity threshold."""
    return _RAY_DISK_SAID.is_set()


class _LoggingErrors:
    """Holds, per process, Python's report of a failed log write ("--- Logging error ---", then the traceback, the
    call stack and the record: `logging.Handler.handleError`) until its last line; leaves it out where the error is
    a full disk (Ray's processes writing their logs to a full temp directory, which raydiff's warning or the
    raylet's line says), else lets it through whole."""

    START, ENDS = "--- Logging error ---", ("Arguments: ", "Use the traceback above")
    LONGEST = 500  # lines: a report cut short (its process died) is let through, not held for ever

    def __init__(self) -> None:
        self._held: dict[Any, list[str]] = {}

    def shown(self, pid: Any, line: str) -> list[str]:
        """The lines of `pid` to show now, `line` the next one."""
        held = self._held.get(pid)
        if held is None and not line.startswith(self.START):
            return [line]
        if held is None:
            self._held[pid] = [line]
            return []
        held.append(line)
        if not line.startswith(self.ENDS) and len(held) < self.LONGEST:
            return []
        del self._held[pid]
        full = any(permanent_reason_in(line) in FULL for line in held if EXCEPTION_LINE.match(line))
        return [] if full else held


def _ray_disk_line(line: str) -> bool:
    """Whether `line` is Ray's noise about its own full disk that is left out: the raylet's line once said, and the
    C++ logger's failed writes to a full disk (any other failure of its shows)."""
    if _LOG_WRITE_FAILED.match(line):
        return permanent_reason_in(line) in FULL
    if not _RAY_DISK_OVER.search(line):
        return False
    return _RAY_DISK_WATCHED.is_set() or not _first_to_say()


def drop_worker_lines(*patterns: re.Pattern) -> None:
    """From now on in this process, worker lines that match `patterns` are dropped too: lines routine in one
    command (a sweep) that would signal a fault in another (a single run). For the rest of the process, not a
    block: Ray forwards a worker's line when it comes, which can be after the work that caused it has returned."""
    _ROUTINE_HERE.extend(p for p in patterns if p not in _ROUTINE_HERE)


def filter_worker_output() -> None:
    """From now on in this process, the worker output Ray forwards to this driver goes through the filters above
    (installed once)."""
    printers = [(name, handler) for name, handler in dispatcher.handlers if name == "ray_print_logs"]
    if not printers or printers[0][1] in _INSTALLED_FILTERS:
        return
    print_lines = printers[0][1]

    controller_tracebacks, logging_errors = _ControllerTracebacks(), _LoggingErrors()

    def filtered(data: dict[str, Any]) -> None:
        harmless, pid = (*HARMLESS_WORKER_LINES, *_ROUTINE_HERE), data.get("pid")
        lines = [shown for line in data.get("lines", []) if not any(p.search(line) for p in harmless)
                 for kept in controller_tracebacks.shown(pid, line) if not _ray_disk_line(kept)
                 for shown in logging_errors.shown(pid, kept)]
        if lines:
            print_lines({**data, "lines": lines})

    _INSTALLED_FILTERS.append(filtered)
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", filtered)
