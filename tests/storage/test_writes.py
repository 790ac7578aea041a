"""Storage writes off the training thread: order kept, errors surfaced at drain, metrics rows never blocked."""

from __future__ import annotations

import json
import threading
import time

import pytest

from raydiff.runs.runlog import JsonlLog
from raydiff.storage.writes import BackgroundWrites, failed_write


class SlowStore:
    """A remote run directory whose every write takes `delay_s` (an object store PUT), recorded in order."""

    remote = True

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.files, self.writes, self.threads = delay_s, {}, [], set()

    def is_file(self, name: str) -> bool:
        return name in self.files

    def read_text(self, name: str) -> str:
        return self.files[name]

    def write_text(self, name: str, text: str) -> None:
        time.sleep(self.delay_s)
        self.files[name] = text
        self.writes.append(text)
        self.threads.add(threading.current_thread().name)


def test_metrics_flushes_leave_the_training_thread_in_order():
    store, writes = SlowStore(0.3), BackgroundWrites()
    log = JsonlLog(store, "metrics.jsonl", flush_every_s=0, writes=writes)
    started = time.perf_counter()
    for step in (10, 20, 30):
        log.append({"step": step, "loss": 1.0 / step})  # each append flushes (flush_every_s=0)
    assert time.perf_counter() - started < 0.3  # three 0.3 s PUTs, none waited for
    writes.drain()
    assert [len(text.splitlines()) for text in store.writes] == [1, 2, 3]  # snapshots, written in order
    assert [json.loads(line)["step"] for line in store.files["metrics.jsonl"].splitlines()] == [10, 20, 30]
    assert store.threads == {t for t in store.threads if t.startswith("raydiff-writes")}
    writes.close()


def test_a_failed_write_is_raised_at_drain():
    writes = BackgroundWrites()

    def fail() -> None:
        raise OSError("bucket unreachable")

    writes.submit("samples/step_00000010.png", fail)
    writes.submit("metrics.jsonl", lambda: None)
    with pytest.raises(OSError, match="bucket unreachable") as raised:
        writes.drain()
    assert failed_write(raised.value) == "samples/step_00000010.png"  # what the one line names
    assert failed_write(OSError("elsewhere")) is None
    writes.drain()  # reported once
    writes.close()


def test_a_worker_whose_last_flush_fails_still_ends_its_writer_thread():
    """A full disk at the final flush skipped the writer's close: its thread stayed, past the worker's end."""
    import errno
    from types import SimpleNamespace

    from raydiff.training.worker import Worker

    class FullDisk:
        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    writes = BackgroundWrites()
    writes.submit("a", lambda: None)
    closed = []
    debug = SimpleNamespace(close=lambda: closed.append(1))
    worker = SimpleNamespace(metrics_log=FullDisk(), writes=writes, debug=debug)
    with pytest.raises(OSError):
        Worker.close(worker)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while any(t.name.startswith("raydiff-writes") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("raydiff-writes")] and closed == [1]
