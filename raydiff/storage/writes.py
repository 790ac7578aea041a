"""Storage writes off the training thread: an object store PUT can take a second; a step should not wait for it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundWrites:
    """Runs writes one at a time, in the order they were submitted, on one thread. `drain()` waits for all of
    them and raises the first error, so a checkpoint can make sure what came before it is on storage."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydiff-writes")
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._pool.submit(fn, *args))

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()  # raises the write's error here, on the training thread

    def raise_failed(self) -> None:
        """Raise the first error of the writes that have finished, without waiting for the others."""
        failed = next((f for f in self._pending if f.done() and f.exception() is not None), None)
        if failed is not None:
            self._pending.remove(failed)
            failed.result()

    def close(self, *, drain: bool = True) -> None:
        """Wait for the writes (raising the first error), or with `drain` False drop those not yet started."""
        try:
            if drain:
                self.drain()
        finally:
            self._pool.shutdown(wait=drain, cancel_futures=not drain)
