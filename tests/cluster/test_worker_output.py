"""What Ray's processes print reaches the driver's terminal whole, except the tracebacks of what raydiff says in one
line: each filter on the lines of its kind, one process's lines among another's."""

from __future__ import annotations

from raydiff.cluster.worker_output import (
    _RAY_DISK_SAID,
    _RAY_DISK_WATCHED,
    _ControllerTracebacks,
    _LoggingErrors,
    _ray_disk_line,
    ray_disk_warned,
    raydiff_watches_ray_disk,
)


def test_only_a_controller_traceback_for_a_full_disk_is_left_out_of_the_workers_lines():
    """Ray Train's controller logs a traceback for a full disk under its checkpoint list, then fails the run,
    which the driver says in one line: that block goes, per process; any other error keeps its traceback."""
    full = ["Error in control loop iteration: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space "
            "left on device", "Traceback (most recent call last):", '  File "checkpoint_manager.py", line 504, in w',
            "    f.write(snapshot)", "    ^^^^^^^^^^^^^^^^^", "OSError: [Errno 28] Error writing bytes to file. "
            "Detail: [errno 28] No space left on device"]
    bug = ["Error in control loop iteration: division by zero", "Traceback (most recent call last):",
           '  File "controller.py", line 1, in _step', "ZeroDivisionError: division by zero"]
    lines = _ControllerTracebacks()
    kept = [(pid, shown) for pid, line in [(1, full[0]), (1, full[1]), (2, "another process's line"), *[
        (1, line) for line in full[2:]], (1, "[raydiff] the next line"), *[(1, line) for line in bug]]
        for shown in lines.shown(pid, line)]
    assert kept == [(2, "another process's line"), (1, "[raydiff] the next line"), *[(1, line) for line in bug]]


def test_workers_waiting_for_room_on_the_cluster_are_a_line_per_try_instead_of_a_traceback():
    """Ray Train gives up on starting the workers after its start timeout and tries again for as long as it takes,
    its controller logging a traceback each time: each becomes one line, which counts the wait, per controller."""
    def no_room(seconds: str, workers: int) -> list[str]:
        message = (f"The worker group startup timed out after {seconds} seconds waiting for {workers} workers. "
                   f"Potential causes include: (1) temporary insufficient cluster resources")
        return [f"Error in control loop iteration: {message}", "Traceback (most recent call last):",
                '  File "worker_group.py", line 303, in _start_impl', "    raise WorkerGroupStartupTimeoutError(",
                f"ray.train.v2._internal.exceptions.WorkerGroupStartupTimeoutError: {message}"]

    lines = _ControllerTracebacks()
    shown = [(pid, shown) for pid, line in [*[(1, line) for line in no_room("60.0", 2)],
                                            (2, "another process's line"), *[(1, line) for line in no_room("60.0", 2)],
                                            *[(3, line) for line in no_room("5.0", 1)], (1, "[raydiff] starting")]
             for shown in lines.shown(pid, line)]
    assert shown == [
        (1, "[raydiff] waiting for room on the cluster for 2 workers: none for 60 s (its resources are in use, or "
            "nodes are still being added); Ray Train tries again until there is"),
        (2, "another process's line"),
        (1, "[raydiff] still waiting for room on the cluster for 2 workers: 120 s so far"),
        (3, "[raydiff] waiting for room on the cluster for 1 worker: none for 5 s (its resources are in use, or "
            "nodes are still being added); Ray Train tries again until there is"),
        (1, "[raydiff] starting")]


def test_only_a_failed_log_write_to_a_full_disk_is_left_out_and_any_other_is_shown_whole():
    """Python's logging reports a handler's failed write with a traceback, the call stack and the record; Ray's
    processes whose temp directory is full report one for each line they log."""
    full = ["--- Logging error ---", "Traceback (most recent call last):", '  File "logging/__init__.py", line 1114',
            "    self.flush()", "OSError: [Errno 28] No space left on device", "Call stack:",
            '  File "checkpoint_manager.py", line 306', "Message: 'Deleting checkpoint: %s'", "Arguments: ('c',)"]
    bug = ["--- Logging error ---", "Traceback (most recent call last):", '  File "logging/__init__.py", line 1110',
           "TypeError: not all arguments converted during string formatting", "Call stack:", '  File "x.py", line 1',
           "Message: 'step %d'", "Arguments: (1, 2)"]
    denied = [line.replace("OSError: [Errno 28] No space left on device", "PermissionError: [Errno 13] Permission "
                           "denied: 'raylet.out'") for line in full]
    reports = _LoggingErrors()
    shown = [(pid, shown) for pid, line in [(1, full[0]), (2, "another process's line"), *[(1, line) for line in
             full[1:]], (1, "[raydiff] the next line"), *[(3, line) for line in bug + denied]]
             for shown in reports.shown(pid, line)]
    assert shown == [(2, "another process's line"), (1, "[raydiff] the next line"),
                     *[(3, line) for line in bug + denied]]


def test_ray_s_lines_about_its_own_full_disk_are_said_once_and_its_logger_s_failed_writes_go():
    raylet = ("[2026-11-28 22:56:07,875 E 6071 6086] (raylet) file_system_monitor.cc:116: /tmp/ray/session_x is "
              "over 95% full, available space: 0 GB; capacity: 1 GB. Object creation will fail if spilling is "
              "required.")
    full = ("[*** LOG ERROR #0001 ***] [2026-11-28 22:56:54] [ray_log_sink] Failed writing to file /tmp/ray/session_x/"
            "logs/python-core-worker-1.log: No space left on device")
    other = "[*** LOG ERROR #0001 ***] [2026-11-28 22:56:54] [ray_log_sink] Failed to open file: Permission denied"
    try:
        # A joined cluster's node: its raylet's first line says it.
        assert [_ray_disk_line(line) for line in (raylet, full, raylet, other, raylet)] == [
            False, True, True, False, True]
        assert ray_disk_warned()
        # A local instance's disk, which raydiff watches and says itself, whichever comes first.
        _RAY_DISK_SAID.clear()
        raydiff_watches_ray_disk()
        assert _ray_disk_line(raylet) and not ray_disk_warned()
    finally:
        _RAY_DISK_SAID.clear()
        _RAY_DISK_WATCHED.clear()
