"""Stopping a run cleanly: SIGTERM (`ray job stop`, a scheduler) or Ctrl-C ends it with a final checkpoint, or,
before training has started (decoding, preparing streamed data), at once (`raydiff.training.interrupts`).

During training the driver's signal handler raises a flag in a small Ray actor; the workers look at it every few
steps (rank 0 asks, all ranks agree through an all-reduce), write a checkpoint, and return. A second Ctrl-C
interrupts at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import ray

logger = logging.getLogger("raydiff")


@ray.remote(num_cpus=0)
class StopFlag:
    """Holds the reason the driver was asked to stop, if it was."""

    def __init__(self) -> None:
        self._reason: str | None = None

    def request(self, reason: str) -> None:
        self._reason = self._reason or reason

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
    if threading.current_thread() is not threading.main_thread():
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
        received["signal"] = received["signal"] or name
        print(f"[raydiff] {name}: stopping after a final checkpoint (Ctrl-C again to stop at once)", flush=True)
        wake.set()

    forwarder = threading.Thread(target=forward, daemon=True, name="raydiff-stop")
    forwarder.start()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        wake.set()
