"""What every entry point shares: user mistakes become one line on stderr and exit code 2.

Nothing here imports torch or Ray (each takes seconds to import): a mistake found before a command needs them
(a bad `--set`, a missing file, `--help`) is answered at once.
"""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from raydiff.cluster.errors import NoWorkerNode, RayUnreachable
from raydiff.config import ConfigError
from raydiff.data.errors import DataError
from raydiff.quality.errors import QualityError
from raydiff.runs.errors import Unresumable
from raydiff.storage.errors import StorageFailure
from raydiff.storage.rundir import RunInUse
from raydiff.training.interrupts import Interrupted

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
        # Leave Ray at once (its exit hook would wait half a second first), where the command joined it.
        if "raydiff.cluster.start" in sys.modules:
            sys.modules["raydiff.cluster.start"].leave_ray()
    return 2


def exit_with(main: Callable[[list[str] | None], int]) -> NoReturn:
    """A command as its process's entry point: run it, then exit with its status."""
    status = run(main)
    # The process ends here: spare it the interpreter's last full garbage collection over the objects of torch and
    # Ray (most of a second). Files are closed and Ray left by now; atexit hooks still run.
    gc.freeze()
    sys.exit(status)
