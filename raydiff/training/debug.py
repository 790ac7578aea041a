"""The `debug.*` keys behind one object: fault injection and audit trails, for testing raydiff itself.

Why one object: the training loop calls the same three hooks whatever is switched on, and with the defaults
every hook does nothing, so the loop reads as training and nothing else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import IO

from raydiff.config import Config
from raydiff.data.loader import MicroBatch
from raydiff.storage.rundir import RunDir


class DebugHooks:
    """debug.step_delay_s, debug.record_order, debug.nan_at_steps, debug.nan_at_samples,
    debug.preemption_from_step and debug.hang_at_step, for one worker."""

    def __init__(self, cfg: Config, run_dir: RunDir, rank: int) -> None:
        self._debug = cfg.debug
        self._is_chief = rank == 0
        self._hangs = cfg.debug.hang_at_step > 0 and rank == 1
        self._run_dir = run_dir
        self._faulted_steps: set[int] = set()
        self._poisoned = frozenset(cfg.debug.nan_at_samples)
        self._order_log: IO[str] | None = _order_log(run_dir, rank) if cfg.debug.record_order else None

    def before_step(self, step: int, batches: list[MicroBatch]) -> None:
        """Slow the step down (debug.step_delay_s), record the samples it trains (debug.record_order), or hang
        (debug.hang_at_step)."""
        if self._debug.step_delay_s:
            time.sleep(self._debug.step_delay_s)
        if self._hangs and step == self._debug.hang_at_step and _first_time(self._run_dir, f"hung_at_step_{step}"):
            threading.Event().wait()  # until Ray Train stops this worker's process
        if self._order_log is not None:
            first, last = batches[0], batches[-1]
            self._order_log.write(json.dumps({"step": step, "positions": [first.position, last.position + len(last)],
                                              "indices": [int(i) for b in batches for i in b.indices],
                                              **_labels_of(batches)}) + "\n")

    def fault(self, step: int) -> Callable[[MicroBatch], bool] | None:
        """Whether a micro-batch of optimizer step `step` gets a non-finite loss (None: never): debug.nan_at_steps
        is a transient fault, once per step number, on rank 0; debug.nan_at_samples a persistent one, every time
        one of those samples is trained (a poisoned image)."""
        if not self._debug.nan_at_steps and not self._poisoned:
            return None

        def faulty(batch: MicroBatch) -> bool:
            if self._is_chief and step in self._debug.nan_at_steps and step not in self._faulted_steps:
                self._faulted_steps.add(step)
                return True
            return bool(self._poisoned) and not self._poisoned.isdisjoint(batch.indices.tolist())

        return faulty

    def preemption_notice(self, step: int) -> bool:
        """debug.preemption_from_step: act as if a preemption notice arrived at that step and stays."""
        return 0 < self._debug.preemption_from_step <= step

    def close(self) -> None:
        if self._order_log is not None:
            self._order_log.close()


def _labels_of(batches) -> dict[str, list[int]]:
    """A class-conditional step's class ids as trained (the null class where dropped), for the order audit."""
    if batches[0].labels is None:
        return {}
    return {"labels": [c for b in batches for c in b.labels.tolist()]}  # one read each (on the device: data.on_device)


def _first_time(run_dir: RunDir, name: str) -> bool:
    """Whether this run meets `<run>/debug/<name>` for the first time (a restart meets it again)."""
    if run_dir.local is None:
        raise ValueError(f"debug.hang_at_step needs a local run.storage, not {run_dir}")
    folder = run_dir.local / "debug"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        (folder / name).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def _order_log(run_dir: RunDir, rank: int) -> IO[str]:
    """Audit trail of the samples this worker trains on (a local run.storage only)."""
    if run_dir.local is None:
        raise ValueError(f"debug.record_order needs a local run.storage, not {run_dir}")
    folder = run_dir.local / "order"
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"rank{rank}_pid{os.getpid()}.jsonl", "a", buffering=1)
