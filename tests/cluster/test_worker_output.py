"""What Ray's processes print reaches the driver's terminal whole, except the tracebacks of what raydiff says in one
line: each filter on the lines of its kind, one process's lines among another's."""

from __future__ import annotations

from raydiff.cluster.worker_output import _LoggingErrors, _StorageTracebacks


def test_only_a_controller_traceback_for_a_full_disk_is_left_out_of_the_workers_lines():
    """Ray Train's controller logs a traceback for a full disk under its checkpoint list, then fails the run,
    which the driver says in one line: that block goes, per process; any other error keeps its traceback."""
    full = ["Error in control loop iteration: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space "
            "left on device", "Traceback (most recent call last):", '  File "checkpoint_manager.py", line 504, in w',
            "    f.write(snapshot)", "    ^^^^^^^^^^^^^^^^^", "OSError: [Errno 28] Error writing bytes to file. "
            "Detail: [errno 28] No space left on device"]
    bug = ["Error in control loop iteration: division by zero", "Traceback (most recent call last):",
           '  File "controller.py", line 1, in _step', "ZeroDivisionError: division by zero"]
    lines = _StorageTracebacks()
    kept = [(pid, line) for pid, line in [(1, full[0]), (1, full[1]), (2, "another process's line"), *[
        (1, line) for line in full[2:]], (1, "[raydiff] the next line"), *[(1, line) for line in bug]]
        if lines.keep(pid, line)]
    assert kept == [(2, "another process's line"), (1, "[raydiff] the next line"), *[(1, line) for line in bug]]


def test_only_a_failed_log_write_to_a_full_disk_is_left_out_whole_and_any_other_is_shown_whole():
    """Python's logging reports a handler's failed write with a traceback, the call stack and the record; Ray's
    processes whose temp directory is full report one for each line they log."""
    full = ["--- Logging error ---", "Traceback (most recent call last):", '  File "logging/__init__.py", line 1114',
            "    self.flush()", "OSError: [Errno 28] No space left on device", "Call stack:",
            '  File "checkpoint_manager.py", line 306', "Message: 'Deleting checkpoint: %s'", "Arguments: ('c',)"]
    bug = ["--- Logging error ---", "Traceback (most recent call last):", '  File "logging/__init__.py", line 1110',
           "TypeError: not all arguments converted during string formatting", "Call stack:", '  File "x.py", line 1',
           "Message: 'step %d'", "Arguments: (1, 2)"]
    reports = _LoggingErrors()
    shown = [(pid, shown) for pid, line in [(1, full[0]), (2, "another process's line"), *[(1, line) for line in
             full[1:]], (1, "[raydiff] the next line"), *[(3, line) for line in bug]]
             for shown in reports.shown(pid, line)]
    assert shown == [(2, "another process's line"), (1, "[raydiff] the next line"), *[(3, line) for line in bug]]
