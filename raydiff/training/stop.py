"""Stopping a run cleanly: SIGTERM (`ray job stop`, a scheduler) or Ctrl-C ends it with a final checkpoint, or,
before training has started (decoding, preparing streamed data), at once (`raydiff.training.interrupts`).

During training the driver's signal handler raises a flag in a small Ray actor; the workers look at it every few
steps (rank 0 asks, all ranks agree through an all-reduce), write a checkpoint, and return. A second Ctrl-C
interrupts at once. Ray Train's `fit()`, called in the main thread, would replace the SIGINT handler with its own,
which aborts the run without a checkpoint: `beside_the_handlers` calls it from a helper thread instead.

A sweep keeps Ray Tune's own SIGINT handler, which saves Tune's state and ends the sweep (its trials continue from
their checkpoints when the command runs again), and SIGTERM is passed on to it: `noting_tune_interrupt` tells the
command that it happened.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray

from raydiff.training.interrupts import SAME_SIGTERM_S, in_main_thread, raise_interrupted, signal_handlers

logger = logging.getLogger("raydiff")
T = TypeVar("T")
TUNE_INTERRUPTED = "Experiment has been interrupted"  # how Tune's warning after a Ctrl-C begins (ray.tune.tune)


LEASE_LOST = "the run's lease was taken over"  # a stop that writes nothing more: another driver holds the run


@ray.remote(num_cpus=0)
class StopFlag:
    """Holds the reason the driver was asked to stop, if it was (a lost lease over any other)."""

    def __init__(self) -> None:
        self._reason: str | None = None

    def request(self, reason: str) -> None:
        if self._reason is None or reason == LEASE_LOST:
            self._reason = reason

    def reason(self) -> str | None:
        return self._reason


def stop_reason(flag) -> str | None:
    """The stop request the driver received, or None (also when the flag cannot be reached)."""
    if flag is None:
        return None
    try:
        return ray.get(flag.reason.remote(), timeout=5)
    except Exception:  # the driver is gone (its job ends anyway) or busy: keep training  # noqa: BLE001
        return None


@contextlib.contextmanager
def stop_on_signals(flag) -> Iterator[dict[str, str | None]]:
    """While active, SIGTERM and the first SIGINT ask the run to stop with a final checkpoint (the yielded dict
    gets the signal's name); a second SIGINT raises KeyboardInterrupt. Only in the main thread (a Tune trial
    runs elsewhere and is stopped by Tune)."""
    received: dict[str, str | None] = {"signal": None}
    if not in_main_thread():
        yield received
        return
    wake = threading.Event()

    def forward() -> None:  # Ray calls from a helper thread, not from inside the signal handler
        wake.wait()
        if received["signal"]:
            flag.request.remote(received["signal"])

    def handler(signum, frame) -> None:
        name = signal.Signals(signum).name
        if received["signal"] == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if received["signal"] is not None:  # the stop already asked for: nothing new to say
            return
        received["signal"] = name
        again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""  # a SIGTERM's stop is kept
        print(f"[raydiff] {name}: stopping after a final checkpoint{again}", flush=True)
        wake.set()

    forwarder = threading.Thread(target=forward, daemon=True, name="raydiff-stop")
    forwarder.start()
    try:
        with signal_handlers({signal.SIGTERM: handler, signal.SIGINT: handler}):
            yield received
    finally:
        wake.set()


def beside_the_handlers(call: Callable[[], T]) -> T:
    """`call()`, run in a helper thread while the main thread waits, so that it cannot replace the main thread's
    signal handlers (only the main thread can install one). Ray Train's `fit()` installs a SIGINT handler of its
    own that aborts the run: the workers are killed without a final checkpoint and the command exits 1 with
    nothing printed. The main thread's wait is interrupted by signals, so raydiff's handlers still run, and a
    second Ctrl-C still stops at once (the helper thread is a daemon: it does not hold the process)."""
    if not in_main_thread():
        return call()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # re-raised in the main thread  # noqa: BLE001
            outcome["error"] = exc

    helper = threading.Thread(target=run, daemon=True, name="raydiff-fit")
    helper.start()
    helper.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def noting_tune_interrupt() -> Iterator[dict[str, str | None]]:
    """While active, a Ctrl-C or SIGTERM that ends a Ray Tune sweep is noted in the yielded dict ("signal").
    Tune's SIGINT handler saves its state and ends the sweep, then warns "... Resume experiment with:
    Tuner.restore(...)", a Python call where running the same command again is what continues it: that warning
    is noted and dropped (the command says what to do). Tune has no SIGTERM handler (`ray job stop`, schedulers):
    SIGTERM is passed on to Tune's as a SIGINT, so that Tune saves its state too; a second SIGTERM (after
    SAME_SIGTERM_S) stops at once (`Interrupted`), as a second Ctrl-C does. Tune leaves its handler installed after
    a sweep; the ones before come back."""
    received: dict[str, str | None] = {"signal": None}
    terminated_at: float | None = None  # when the first SIGTERM came
    tune_log = logging.getLogger("ray.tune.tune")

    def note(record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(TUNE_INTERRUPTED):
            received["signal"] = "SIGTERM" if terminated_at is not None else "SIGINT"
            return False
        return True

    def as_ctrl_c(signum, frame) -> None:
        nonlocal terminated_at
        if terminated_at is not None:
            if time.monotonic() - terminated_at < SAME_SIGTERM_S:  # the same request, to the command and its group
                return
            raise_interrupted(signum, before_training=False)  # as a second Ctrl-C does, naming the signal
        terminated_at = time.monotonic()
        signal.raise_signal(signal.SIGINT)  # Tune's handler

    # SIGINT keeps its handler until Tune replaces it, and gets it back after.
    keep_sigint = signal.getsignal(signal.SIGINT) if in_main_thread() else None
    tune_log.addFilter(note)
    try:
        with signal_handlers({signal.SIGTERM: as_ctrl_c, signal.SIGINT: keep_sigint}):
            yield received
    finally:
        tune_log.removeFilter(note)
