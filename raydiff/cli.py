"""What every entry point shares: user mistakes become one line on stderr and exit code 2.

A mistake in a command's arguments is one line too (`Parser`, the ArgumentParser every command builds): the
refusal and where the command's usage is, not argparse's usage block above it.

Nothing here imports torch or Ray (each takes seconds to import): a mistake found before a command needs them
(a bad `--set`, a missing file, `--help`) is answered at once.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

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


class Parser(argparse.ArgumentParser):
    """The commands' ArgumentParser: an argument error, argparse's own (an unknown flag, a missing value, a bad
    choice) or a command's (`parser.error`), is one line naming the command, exit code 2:

        raydiff: error: --num 0: must be >= 1 (python -m raydiff.sample --help)

    A `--set` value without '=' followed by its value (`--set train.lr 1e-3`, which argparse would call an
    unrecognized 1e-3) is told as the typo it is. Sub-commands' parsers (`add_subparsers`) are Parsers too."""

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(argv, namespace)
        if extras and "--set" in self._option_string_actions:
            typo = set_without_equals(argv, extras)
            if typo:
                self.error(typo)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.splitlines())
        self.exit(2, f"raydiff: error: {line} ({self.prog} --help)\n")


def set_without_equals(argv: list[str], extras: list[str]) -> str | None:
    """The refusal of a `--set KEY VALUE` in `argv` (a space where the '=' goes, VALUE left among argparse's
    unrecognized `extras`), as `--set KEY: expected KEY=VALUE, as --set KEY=VALUE`; None where there is none."""
    for i, token in enumerate(argv):
        if token == "--set" and i + 1 < len(argv):
            key, after = argv[i + 1], i + 2
        elif token.startswith("--set="):
            key, after = token.removeprefix("--set="), i + 1
        else:
            continue
        if "=" not in key and after < len(argv) and argv[after] in extras:
            return f"--set {key}: expected KEY=VALUE, as --set {key}={argv[after]}"
    return None


def refuse_empty(parser: argparse.ArgumentParser, name: str, value: str, allowed: str) -> None:
    """Refuse an empty (or blank) output location as a mistake in the command line (`parser.error`: one line, exit
    code 2): Path("") is ".", so an unset shell variable would write into the current folder (and `raydiff.sample`
    prune the samples there). `name` is the argument's ("--out", or "OUT" for a positional); `allowed` what it
    takes."""
    if not value.strip():
        parser.error(f"{setting_with(name, value)}: must name {allowed} (an empty value would mean the current "
                     f"folder)")


def refuse_remote(parser: argparse.ArgumentParser, name: str, value: str) -> None:
    """Refuse a URI (`s3://`, `gs://`, any `scheme://`) for an output this command writes only locally: Path()
    reads `s3://b/x` as the local folders `s3:/b/x`, so the output went there, silently."""
    if "://" in value:
        parser.error(f"{setting_with(name, value)}: must be a local path (write it here, then copy it to the "
                     f"bucket: `aws s3 cp --recursive`, `gcloud storage cp -r`)")


def exit_with(main: Callable[[list[str] | None], int]) -> NoReturn:
    """A command as its process's entry point: run it, then exit with its status."""
    status = run(main)
    # The process ends here: spare it the interpreter's last full garbage collection over the objects of torch and
    # Ray (most of a second). Files are closed and Ray left by now; atexit hooks still run.
    gc.freeze()
    sys.exit(status)
