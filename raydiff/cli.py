"""What every entry point shares: user mistakes become one line on stderr and exit code 2.

Nothing here imports torch or Ray (each takes seconds to import): a mistake found before a command needs them
(a bad `--set`, a missing file, `--help`) is answered at once.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from raydiff.cluster.errors import NoWorkerNode, RayCannotStart, RayUnreachable
from raydiff.config import ConfigError
from raydiff.data.errors import DataError
from raydiff.quality.errors import QualityError
from raydiff.runs.errors import Unresumable
from raydiff.storage.errors import StorageFailure, disk_failure, setting_with
from raydiff.storage.rundir import RunInUse
from raydiff.training.interrupts import Interrupted, last_interrupt, sigterm_raises
from raydiff.training.sweep import TrialFailed

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, Unresumable, QualityError, RunInUse, NoWorkerNode,
               StorageFailure, RayUnreachable, RayCannotStart, TrialFailed)


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    try:
        with sigterm_raises():
            return main(argv)
    except ConfigError as exc:
        print(f"raydiff: config error: {exc}", file=sys.stderr)
    except USER_ERRORS as exc:
        print(f"raydiff: error: {exc}", file=sys.stderr)
    except OSError as exc:  # a full or read-only disk met where no command expected a write to fail
        line = disk_failure(exc)
        if line is None:
            raise
        print(f"raydiff: error: {line}", file=sys.stderr)
    except KeyboardInterrupt as exc:  # Ctrl-C, or a signal's Interrupted (which Ray may re-raise as a plain one)
        stopped = exc if isinstance(exc, Interrupted) else last_interrupt()
        if stopped is None:
            print("raydiff: interrupted", file=sys.stderr)
            return 130
        note = f"; {stopped.note}" if stopped.note else ""
        print(f"raydiff: stopped by {stopped.signal} before training began; nothing was trained (the same command "
              f"starts again)" if stopped.before_training else f"raydiff: stopped by {stopped.signal}{note}",
              file=sys.stderr)
        return 128 + signal.Signals[stopped.signal].value
    finally:
        # Leave Ray at once (its exit hook would wait half a second first), where the command joined it.
        if "raydiff.cluster.start" in sys.modules:
            sys.modules["raydiff.cluster.start"].leave_ray()
    return 2


def refuse_empty(parser: argparse.ArgumentParser, name: str, value: str, allowed: str) -> None:
    """Refuse an empty (or blank) output location as a mistake in the command line (`parser.error`: exit code 2):
    Path("") is ".", so an unset shell variable would write into the current folder (and `raydiff.sample` prune
    the samples there). `name` is the argument's ("--out", or "OUT" for a positional); `allowed` what it takes."""
    if not value.strip():
        parser.error(f"{setting_with(name, value)}: must name {allowed} (an empty value would mean the current "
                     f"folder)")


def exit_with(main: Callable[[list[str] | None], int]) -> NoReturn:
    """A command as its process's entry point: run it, then exit with its status."""
    status = run(main)
    # The process ends here: spare it the interpreter's last full garbage collection over the objects of torch and
    # Ray (most of a second). Files are closed and Ray left by now; atexit hooks still run.
    gc.freeze()
    sys.exit(status)
