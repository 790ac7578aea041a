"""Storage writes off the training thread: an object store PUT can take a second; a step should not wait for it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

WRITING = "while writing in the background: "  # the note a failed write's error carries, then the file


class BackgroundWrites:
    """Runs writes one at a time, in the order they were submitted, on one thread. `drain()` waits for all of
    them and raises the first error, so a checkpoint can make sure what came before it is on storage. A write's
    error carries the file it was writing (`failed_write`), for the one line that says what failed."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydiff-writes")
        self._pending: list[tuple[str, Future]] = []

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` after the writes before it; `what` is the file it writes, as the run directory names it."""
        self._pending = [(w, f) for w, f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append((what, self._pool.submit(fn, *args)))

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for what, future in pending:
            _result(what, future)  # raises the write's error here, on the training thread

    def raise_failed(self) -> None:
        """Raise the first error of the writes that have finished, without waiting for the others."""
        failed = next(((w, f) for w, f in self._pending if f.done() and f.exception() is not None), None)
        if failed is not None:
            self._pending.remove(failed)
            _result(*failed)

    def close(self, *, drain: bool = True) -> None:
        """Wait for the writes (raising the first error), or with `drain` False drop those not yet started."""
        try:
            if drain:
                self.drain()
        finally:
            self._pool.shutdown(wait=drain, cancel_futures=not drain)


def _result(what: str, future: Future) -> None:
    try:
        future.result()
    except Exception as exc:
        # The list BaseException.add_note keeps (Python 3.11 and later), written so on 3.10 as well.
        exc.__notes__ = [*getattr(exc, "__notes__", ()), WRITING + what]  # type: ignore[attr-defined]
        raise


def failed_write(exc: BaseException) -> str | None:
    """The file whose background write raised `exc`; None for an error of any other origin."""
    return next((note.removeprefix(WRITING) for note in getattr(exc, "__notes__", ()) if note.startswith(WRITING)),
                None)
