"""What every entry point shares: user mistakes become one line on stderr and exit code 2."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from raydiff.cluster.nodes import NoWorkerNode
from raydiff.cluster.start import RayUnreachable, leave_ray
from raydiff.config import ConfigError
from raydiff.data.sources import DataError
from raydiff.quality.features import QualityError
from raydiff.runs.state import Unresumable
from raydiff.storage.errors import StorageFailure
from raydiff.storage.rundir import RunInUse
from raydiff.training.stop import Interrupted

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, Unresumable, QualityError, RunInUse, NoWorkerNode,
               StorageFailure, RayUnreachable)


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    try:
        return main(argv)
    except ConfigError as exc:
        print(f"raydiff: config error: {exc}", file=sys.stderr)
    except USER_ERRORS as exc:
        print(f"raydiff: error: {exc}", file=sys.stderr)
    except Interrupted as exc:
        print(f"raydiff: stopped by {exc.signal} before training began; nothing was trained (the same command starts "
              f"again)", file=sys.stderr)
        return 128 + signal.Signals[exc.signal].value
    except KeyboardInterrupt:
        print("raydiff: interrupted", file=sys.stderr)
        return 130
    finally:
        leave_ray()  # at once: Ray's exit hook would wait half a second first
    return 2


def exit_with(main: Callable[[list[str] | None], int]) -> NoReturn:
    """A command as its process's entry point: run it, then exit with its status."""
    status = run(main)
    # The process ends here: spare it the interpreter's last full garbage collection over the objects of torch and
    # Ray (most of a second). Files are closed and Ray left by now; atexit hooks still run.
    gc.freeze()
    sys.exit(status)
