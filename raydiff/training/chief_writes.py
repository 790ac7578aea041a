"""Rank 0's writes during training, and what every worker agrees they came to: the guard that keeps a storage
failure no retry can fix instead of raising it, and the checkpoints written in the background and reported to Ray
Train once they are on storage.

Why apart from `raydiff.training.cadence`: the cadence decides when to write and what a failure stops; this
module holds how a write fails and how the workers learn of it. Checkpoints are written by rank 0
(`raydiff.runs.checkpoint.CheckpointWriter`: never visible before complete) and reported to Ray Train at the next
point where every worker agrees on what rank 0 saw (`settle`, a collective). A write that fails in a way no retry
can fix (a full disk, a read-only folder, a missing bucket, refused credentials) is kept: every worker stops at that
next agreement, rank 0 writes nothing more, and the driver prints one line (see `raydiff.storage.errors`). Other
errors raise, and Ray Train restarts the workers from the last checkpoint. What is written is
`raydiff.training.chief_records`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import ray.train

from raydiff.runs.checkpoint import CheckpointWriter, checkpoint_bytes, checkpoint_name, checkpoint_step
from raydiff.runs.state import Progress, checkpoint_state
from raydiff.storage.errors import StorageFailure, storage_failure
from raydiff.storage.writes import failed_write
from raydiff.training.distributed import from_rank_zero_code
from raydiff.training.worker import Worker

_WRITTEN, _FAILED = 1, 2  # what rank 0 tells the others when they settle


class ChiefWrites:
    """One worker's side of rank 0's writes (the other ranks write nothing, but settle alike).

    :param w: the worker, set up and restored.
    """

    def __init__(self, w: Worker) -> None:
        self.w = w
        self.failure: StorageFailure | None = None  # rank 0: a write no retry can fix (every rank: a rollback's read)
        self.unreported: dict[str, Any] | None = None  # the metrics of the checkpoint being written
        self._written: str | None = None  # rank 0: the name of the checkpoint it wrote last
        self._writer = CheckpointWriter(w.run_dir) if w.is_chief else None

    def write(self, operation: str, fn: Callable[..., Any], *args: Any, checkpoint: bool = False,
              **kwargs: Any) -> None:
        """One of rank 0's writes (a no-op elsewhere). A storage error no retry can fix is kept (every worker stops
        at the next `settle`) and rank 0 writes nothing more; any other error raises. The failure's line names the
        file of a background write that failed (`operation` waited for it), and for a `checkpoint`, what one needs."""
        if not self.w.is_chief or self.failure is not None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            written = failed_write(exc)
            # (what one checkpoint takes: the driver's estimate, which its room check used)
            failure = storage_failure(exc, str(self.w.run_dir), f"writing {written}" if written else operation,
                                      needed_bytes=checkpoint_bytes(self.w.cfg) if checkpoint else None)
            if failure is None:
                raise
            self.failure = failure  # the driver prints it: the one line the user reads

    def event(self, event: str, **fields: Any) -> None:
        self.write(f"writing events.jsonl ({event})", self.w.event, event, *(), **fields)

    def checkpoint(self, progress: Progress, report: dict[str, Any]) -> None:
        """Every worker: `report` waits for the checkpoint of `progress`; rank 0: the rows up to this step on storage,
        then the full state, written in the background. Ray hears of it once it is on storage (`settle`)."""
        self.unreported = report
        if self._writer is None:
            return
        self.write("writing metrics.jsonl", self._flush_logs)  # the rows up to a checkpoint are kept on resume
        self.write(f"writing the checkpoint of step {progress.step}", self._start_checkpoint, progress,
                   checkpoint=True)

    def settle(self, *, wait: bool) -> bool:
        """Every worker, at the same steps: what became of rank 0's checkpoint write and other writes, as rank 0
        tells it (a collective). A checkpoint on storage is reported to Ray Train (with the metrics of its step).
        True where a write no retry can fix failed: training ends on every worker."""
        code = 0
        if self._writer is not None:
            outcome = self._writer.outcome(wait=wait)
            if outcome is not None:
                name, error = outcome
                if error is None:
                    self._written = name
                    code = _WRITTEN
                else:
                    self.write(f"writing the checkpoint of step {checkpoint_step(name)}", _raise, error,
                               checkpoint=True)
            if self.w.writes is not None:
                self.write("writing to the run directory", self.w.writes.raise_failed)
            code = _FAILED if self.failure is not None else code
        code = from_rank_zero_code(code, self.w.device)
        if code == _WRITTEN and self.unreported is not None:
            report, self.unreported = self.unreported, None
            checkpoint = self._ray_checkpoint(self._written) if self.w.is_chief else None
            ray.train.report(report, checkpoint=checkpoint,
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
        return code == _FAILED

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _flush_logs(self) -> None:
        """Rank 0: every metrics row and background write so far, on storage."""
        w = self.w
        assert w.metrics_log is not None and w.writes is not None  # rank 0's
        w.metrics_log.flush()
        w.writes.drain()

    def _start_checkpoint(self, progress: Progress) -> None:
        w = self.w
        assert self._writer is not None  # rank 0's
        name = checkpoint_name(progress.step, w.run_dir)
        state = checkpoint_state(w.training_state, progress, w.cfg.train.global_batch, w.cfg.to_dict(), w.classes)
        self._writer.start(name, state)

    def _ray_checkpoint(self, name: str | None) -> ray.train.Checkpoint:
        """The written checkpoint as Ray Train knows its storage (the same filesystem object it manages)."""
        try:
            storage = ray.train.get_context().get_storage()
            return ray.train.Checkpoint(path=f"{storage.experiment_fs_path}/{name}",
                                        filesystem=storage.storage_filesystem)
        except NotImplementedError:  # Ray Train's local mode (num_workers=0) has no storage context
            return ray.train.Checkpoint(path=f"{self.w.run_dir.path}/{name}", filesystem=self.w.run_dir.fs)


def _raise(error: BaseException) -> None:
    raise error
