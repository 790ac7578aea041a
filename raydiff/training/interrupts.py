"""A command stopped by SIGTERM or Ctrl-C before training started: nothing to save, so it stops at once.

Why a module of its own: data preparation and the driver's decoding use it, and the commands report it
(`raydiff.cli`), before and without Ray; stopping a run that trains is `raydiff.training.stop`'s, with Ray. Every
command turns SIGTERM into an exception, as Python does Ctrl-C (`sigterm_raises`), so that its `finally` blocks
run and it ends with one line.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# `timeout` signals the command, then its process group, which holds the command too: two SIGTERMs within
# microseconds, one request. A second SIGTERM counts as one only this long after the first.
SAME_SIGTERM_S = 1.0


class Interrupted(KeyboardInterrupt):
    """A signal that stops the command at once: SIGTERM, or Ctrl-C before training started (nothing to save yet).
    A KeyboardInterrupt, so that no `except Exception` swallows it and Ray stops waiting for it: `ray.get` checks
    for that one only, and raises a plain KeyboardInterrupt in its place (`last_interrupt` keeps which signal it
    was). Cleanups in `finally` blocks still run."""

    def __init__(self, signal_name: str, before_training: bool = True, note: str = "") -> None:
        super().__init__(signal_name)
        self.signal = signal_name
        self.before_training = before_training  # False: a command that does not train (evaluate, sample, ...)
        self.note = note  # what the command's last line adds, after the signal
        self.at = time.monotonic()


_raised: list[Interrupted] = []  # the newest Interrupted a handler of this module raised, if any


def last_interrupt() -> Interrupted | None:
    """The newest Interrupted raised by a signal during the current command (None after a plain Ctrl-C)."""
    return _raised[-1] if _raised else None


def raise_interrupted(signum: int, before_training: bool, note: str = "") -> None:
    """Raise `Interrupted` for signal `signum`, and keep it for `last_interrupt` (a signal handler's call). A SIGTERM
    within SAME_SIGTERM_S of the one that raised before is the same request (`timeout` sends two) and raises
    nothing: it would break into the cleanups that the first one set going (removing what was half written)."""
    name, last = signal.Signals(signum).name, last_interrupt()
    if name == "SIGTERM" and last is not None and last.signal == name and time.monotonic() - last.at < SAME_SIGTERM_S:
        return
    interrupted = Interrupted(name, before_training, note)
    _raised[:] = [interrupted]
    raise interrupted


def in_main_thread() -> bool:
    """Whether signal handlers can be installed here (only the main thread may; a Tune trial runs elsewhere)."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signal_handlers(handlers: dict[int, Any]) -> Iterator[None]:
    """While active, `handlers` (signal -> handler) in place of the ones before, which come back after. Nothing
    outside the main thread, which alone may install a handler."""
    if not in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@dataclass
class SignalStage:
    """What a signal stops, as `interrupt_on_signals` tells it: nothing trained yet (`before_training`), or
    what the command's last line adds (`note`). The command changes it as it goes (the driver once training
    has ended: a signal while it writes its records and lets go of its lease)."""

    before_training: bool = True
    note: str = ""


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[SignalStage]:
    """While active, SIGTERM and SIGINT raise `Interrupted` in the main thread: a long data preparation is stopped,
    and what it left half-written is removed on the way out; the stage yielded says what the signal stopped. Only
    in the main thread (a Tune trial runs elsewhere and is stopped by Tune)."""
    stage = SignalStage()

    def handler(signum, frame) -> None:
        raise_interrupted(signum, before_training=stage.before_training, note=stage.note)

    with signal_handlers({signal.SIGTERM: handler, signal.SIGINT: handler}):
        yield stage


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active (a whole command), SIGTERM raises `Interrupted` in the main thread, as Ctrl-C raises
    KeyboardInterrupt: cleanups run (Ray is left) and the command ends with one line and exit 143. Ray's own
    handler, which `init_ray` puts this one back over, prints a stack dump and aborts."""
    _raised.clear()
    with signal_handlers({signal.SIGTERM: lambda signum, frame: raise_interrupted(signum, before_training=False)}):
        yield
