"""A command stopped by SIGTERM or Ctrl-C before training started: nothing to save, so it stops at once.

Why a module of its own: data preparation and the driver's decoding use it, and the commands report it
(`raydiff.cli`), before and without Ray; stopping a run that trains is `raydiff.training.stop`'s, with Ray.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Interrupted(BaseException):
    """SIGTERM or Ctrl-C before training started: nothing to save, so the command stops at once (a BaseException,
    like KeyboardInterrupt, so that no `except Exception` swallows it; cleanups in `finally` blocks still run)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal = signal_name


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """While active, SIGTERM and SIGINT raise `Interrupted` in the main thread: a long data preparation is stopped,
    and what it left half-written is removed on the way out. Only in the main thread (a Tune trial runs
    elsewhere and is stopped by Tune)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
