"""What the end of each optimizer step calls for, in this order: the non-finite guard (rollback or give up),
validation and evaluation, the metrics row, the sample grid, the interrupts, the checkpoint, and settling the
checkpoints with Ray Train (and with storage: a write no retry can fix stops the run).

Why one object: the loop (`raydiff.training.loop`) then reads as training, one step per iteration; every cadence,
its state (the newest row, the validation loss, the quality, the last checkpoint, the paused time) and the order
of their side effects live here, and nowhere else. What rank 0 writes for the records (start records, metrics
rows, sample grids, post-hoc snapshots, a rollback) is `raydiff.training.chief_records`.

Rank 0's writes go through `raydiff.training.chief_writes`: a storage failure no retry can fix is kept, and
checkpoints reach Ray Train once they are on storage, both settled at the next point where every worker agrees on
what rank 0 saw (a checkpoint step, a check every CHECK_EVERY_STEPS steps, the end).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import torch

from raydiff.cluster.devices import synchronize
from raydiff.data.loader import Batches, MicroBatch
from raydiff.runs.dashboards import Dashboards, dashboards_for
from raydiff.runs.state import Progress
from raydiff.storage.errors import StorageFailure
from raydiff.storage.lease import describe, watch_for_takeover
from raydiff.training.chief_records import log_row, record_rollback, record_start, save_sample_grid, save_snapshot
from raydiff.training.chief_writes import ChiefWrites
from raydiff.training.distributed import INTERRUPTS, agreed_interrupt, interrupt_asked
from raydiff.training.in_run_quality import ema_drift, evaluate_in_run
from raydiff.training.profiling import StepProfile
from raydiff.training.recovery import divergence_report, roll_back
from raydiff.training.step import StepResult
from raydiff.training.stop import LEASE_LOST
from raydiff.training.window import MetricsWindow, NonFiniteSteps
from raydiff.training.worker import Worker
from raydiff.training.worker_io import WorkerArgs, WorkerResult, WorkerStatus

logger = logging.getLogger("raydiff")
CHECK_EVERY_STEPS = 10  # how often the workers look at the device's counters and agree on stop, preemption, storage


@dataclass
class _Live:
    """What a rollback reopens: the sample stream, the logging window and the non-finite counter."""

    stream: Batches
    window: MetricsWindow
    nonfinite: NonFiniteSteps

    @classmethod
    def open(cls, w: Worker, progress: Progress) -> _Live:
        return cls(stream=w.open_stream(progress), window=MetricsWindow(w.device, progress.window, w.is_chief),
                   nonfinite=NonFiniteSteps(w.device, progress.counters))

    def close(self) -> None:
        self.stream.close()


class Cadence:
    """The cadences of one worker's training, asked once per step what to do.

    :param w: the worker, set up and restored.
    :param progress: where it continues.
    :param args: the driver's arguments (its records of this start, the stop flag).
    """

    def __init__(self, w: Worker, progress: Progress, args: WorkerArgs) -> None:
        self.w, self.start_step = w, progress.step
        self._first_step_done = False
        self.status: WorkerStatus | None = None  # set when training ends before train.total_steps
        self.diagnostic: str | None = None
        self.chief = ChiefWrites(w)  # rank 0's, and the agreement on what they came to
        self._measured_as_of(progress)
        self.last_checkpoint_step = progress.step
        self._stop_flag, self._notice_handled = args.stop_flag, False
        self._data_wait_s = 0.0
        self._profile = StepProfile.planned(w.cfg.log.profile_steps, resumed_at=progress.step, device=w.device,
                                            is_chief=w.is_chief)  # rank 0's, if log.profile_steps asks for one
        snapshot_every = w.cfg.train.ema_snapshot_every
        assert isinstance(snapshot_every, int), "Config.resolve sets train.ema_snapshot_every"
        self._snapshot_every = snapshot_every
        if w.is_chief:
            self.chief.write("writing the run's start records", record_start, w, args, progress)
        self.live = _Live.open(w, progress)
        # Rank 0's TensorBoard / MLflow / W&B; points past the checkpoint (lost work) are hidden on TensorBoard.
        self.dashboards: Dashboards | None = (dashboards_for(w.cfg, w.run_dir, resume_step=progress.step)
                                              if w.is_chief else None)
        self._settle(wait=False)  # storage that refused the start records stops every worker before training
        self.run_start = time.perf_counter()
        # What the progress line's ETA counts from: this start, or the rollback since (not the rolled-back steps).
        self._eta_from = (progress.step, self.run_start)
        # Rank 0 looks at an object store's lease itself: a paused driver would not tell of a takeover. Last:
        # nothing after it raises, so that `close` ends it.
        self._end_watch = watch_for_takeover(
            w.run_dir, args.invocation, stale_s=w.cfg.run.lease_stale_s,
            on_taken=self._taken_over) if w.is_chief and args.stop_flag is not None else None

    def _measured_as_of(self, progress: Progress) -> None:
        """What was measured as of `progress`'s checkpoint (a start's, a rollback's): the steps after it are lost."""
        self.last_row: dict[str, Any] | None = None  # the newest metrics row
        self.val_loss: float | None = progress.measured.get("val_loss")
        self.quality: dict[str, Any] | None = progress.measured.get("quality")  # the newest evaluation's metrics
        self._restored_loss: float | None = progress.measured.get("loss")  # until a row is logged

    def _taken_over(self, holder: dict[str, Any]) -> None:
        """Another driver holds the run's lease (this one's went unrenewed: paused, or cut off): stop at the next
        check, writing nothing more."""
        logger.warning(f"[raydiff] WARNING: the run's lease is held by {describe(holder)} now (this run's driver "
                       f"did not renew it): stopping without writing more")
        assert self._stop_flag is not None  # the watch runs only with one
        self._stop_flag.request.remote(LEASE_LOST)

    # The step's data.
    def next_batches(self, step: int) -> list[MicroBatch]:
        """This worker's micro-batches of optimizer step `step` (counted from 1)."""
        if self._profile is not None:
            self._profile.before_step(step)
        wait_start = time.perf_counter()
        batches = next(self.live.stream)
        self._data_wait_s = time.perf_counter() - wait_start
        self.w.debug.before_step(step, batches)
        return batches

    # The end of a step.
    def end_of_step(self, progress: Progress, result: StepResult, *, lr: float, ema_decay: float) -> Progress:
        """Everything step `progress.step` calls for, in order; returns where training continues (another progress
        after a rollback). Sets `status` when training ends early (diverged, stopped, storage failed)."""
        step = progress.step
        progress = self._step_end(progress, result, lr=lr, ema_decay=ema_decay)
        # The profile ends after its last step's end, or where training ends or rolls back before it; unwritten
        # where another driver holds the run now.
        if self._profile is not None and self.status == WorkerStatus.LEASE_LOST:
            profile, self._profile = self._profile, None
            profile.discard()
        elif self._profile is not None and self._profile.recording and (
                step >= self._profile.last or progress.step != step or self.status is not None):
            self._write_profile(step)
        return progress

    def _step_end(self, progress: Progress, result: StepResult, *, lr: float, ema_decay: float) -> Progress:
        w, t, live = self.w, self.w.cfg.train, self.live
        step = progress.step
        done = step == t.total_steps
        check = step % CHECK_EVERY_STEPS == 0 or done  # the device's counters are read only here
        asked = None
        if check and not done:
            # Ray is asked about a stop or preemption first, while a GPU still works through the steps queued
            # before: reading the counters waits for them, and the GPU would idle through Ray's round trips after.
            asked = interrupt_asked(self._stop_flag, w.is_chief, w.debug.preemption_notice(step))
        # Rank 0 knows now if another driver holds the run (the others learn it at the agreement below): it
        # writes nothing more, no row, grid or snapshot, over what the other run writes.
        writes = w.is_chief and asked != INTERRUPTS.index("lease_lost")
        if not self._first_step_done:  # once a start (a rollback to its first checkpoint starts nothing)
            self._first_step_done = True
            self._after_first_step(step)
        live.window.add(result, self._data_wait_s)
        live.nonfinite.add(result.finite)
        if check:
            progress.counters["skipped_steps"] = live.nonfinite.skipped_steps()

        # Too many non-finite steps in a row: roll back past them once, then give up; not where another driver
        # holds the run now (a stop or preemption asked here is asked again at the next check).
        streak = live.nonfinite.longest_streak() if check else 0  # (since the last check: read once)
        if streak >= t.max_bad_steps:
            # (agreed, not handled: a preemption notice keeps its checkpoint for a later check)
            if asked is not None and agreed_interrupt(asked, w.device) == "lease_lost":
                return self._lease_lost(progress, step)
            return self._roll_back_or_give_up(progress, result, lr, streak)

        # Validate and evaluate at their cadences (the same decision on every worker; not training time).
        with self._paused(self._validation_due(step, done) or self._evaluation_due(step, done)):
            new_val_loss, new_quality = self._validate(step, done), self._evaluate(step, done)
        measured = new_val_loss is not None or new_quality is not None
        self.val_loss = new_val_loss if new_val_loss is not None else self.val_loss
        self.quality = new_quality if new_quality is not None else self.quality

        # A metrics row: metrics.jsonl, the dashboards, the progress line.
        row = None
        if step % t.log_every == 0 or done or measured:
            progress.counters["skipped_steps"] = live.nonfinite.skipped_steps()  # as of this row's step
            row = live.window.close(step=step, global_batch=t.global_batch, lr=lr, ema_decay=ema_decay,
                                    world_size=w.world_size, skipped_steps=progress.counters["skipped_steps"])
            written = time.perf_counter()  # (the device has done the row's steps: close read their sums)
            self.last_row = row = row | self._extra_metrics(new_val_loss, new_quality)
            if writes:
                self.chief.write("writing metrics.jsonl", log_row, w, row, self.dashboards,
                                 start_step=self._eta_from[0], elapsed_s=time.perf_counter() - self._eta_from[1])
            live.window.paused_s += time.perf_counter() - written  # the row's own writing: not the next row's time

        grid_due = writes and ((t.sample_every and step % t.sample_every == 0) or done)
        snapshot_due = writes and w.posthoc is not None and (step % self._snapshot_every == 0 or done)
        # Sampling and checkpointing are not training time either; an interrupt's checkpoint comes at a check.
        with self._paused(grid_due or snapshot_due or check or measured or step % t.checkpoint_every == 0):
            # The sample grid.
            if grid_due:
                save_sample_grid(w, step, self.dashboards, storage_ok=self.chief.failure is None)
            # The post-hoc EMA's snapshot.
            if snapshot_due:
                self.chief.write(f"writing the post-hoc EMA snapshot of step {step}", save_snapshot, w, step)
            # Stop or preemption, agreed by every worker.
            interrupt = self._agree_on_interrupts(asked) if asked is not None else None
            if interrupt == "lease_lost":  # another driver writes to the run now: no checkpoint, no rows
                return self._lease_lost(progress, step)
            # A checkpoint, or the measurements alone: Ray sees checkpoints, validation losses and quality metrics
            # (Tune stops trials on them); other rows go to metrics.jsonl only.
            report = ray_report(step, t.global_batch, self.quality, self.val_loss, row)
            checkpoint = step % t.checkpoint_every == 0 or done or (interrupt and self.last_checkpoint_step != step)
            if checkpoint:
                if self.chief.unreported is not None:  # one write at a time: the previous one first
                    self._settle(wait=True)
                if interrupt:
                    self.chief.event(f"{interrupt}_checkpoint", step=step)
                self._checkpoint(progress, report)
            elif measured:
                ray.train.report(report, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            # What rank 0's writes came to, agreed by every worker: report a written checkpoint, stop on a failure.
            if checkpoint or check:
                self._settle(wait=done or interrupt is not None)
        if interrupt == "stop" and self.status is None:
            self.status = WorkerStatus.STOPPED
        return progress

    def _lease_lost(self, progress: Progress, step: int) -> Progress:
        self.status = WorkerStatus.LEASE_LOST
        self.diagnostic = f": stopped at step {step} without writing more"  # the driver's line says the rest
        return progress

    def result(self, progress: Progress) -> WorkerResult:
        """What this worker returns (the driver reads rank 0's)."""
        t = self.w.cfg.train
        if self.chief.failure is not None:
            self.status, self.diagnostic = WorkerStatus.STORAGE_FAILED, str(self.chief.failure)
        return WorkerResult(self.status or WorkerStatus.FINISHED, steps=progress.step, diagnostic=self.diagnostic,
                            images_seen=progress.step * t.global_batch,
                            final_loss=self._final_loss(), val_loss=self.val_loss,
                            quality=self.quality, skipped_steps=progress.counters["skipped_steps"],
                            rollbacks=progress.counters["rollbacks"], world_size=self.w.world_size,
                            resumed_from_step=self.start_step)

    def _final_loss(self) -> float | None:
        """The last row's loss; None where it has none (every step of its window skipped: NaN)."""
        loss = self.last_row["loss"] if self.last_row else self._restored_loss
        return None if loss is None or math.isnan(loss) else loss

    def close(self) -> None:
        """At the end of training: rank 0's metrics rows and writes reach storage (unless storage failed)."""
        if self._profile is not None:  # still recording: the loop ends on an error
            self._profile.discard()
        writes = self.chief.failure is None and self.status != WorkerStatus.LEASE_LOST
        try:
            if self.w.is_chief and writes:
                self.chief.write("writing metrics.jsonl", self.w.close)
            if not writes or not self.w.is_chief:
                self.w.close(flush=False)
        finally:
            if self._end_watch is not None:
                self._end_watch()
            self.chief.close()
            self.live.close()
            if self.dashboards is not None:
                self.dashboards.close(publish=self.status != WorkerStatus.LEASE_LOST)

    # The pieces, in the order a step's end calls them.
    def _roll_back_or_give_up(self, progress: Progress, result: StepResult, lr: float, streak: int) -> Progress:
        """Back to the newest checkpoint, past the failed steps' data, once; the second time, a diagnostic.
        `streak`: the longest run of non-finite steps since the last check."""
        w, t = self.w, self.w.cfg.train
        if self.chief.unreported is not None:  # the checkpoint being written: the one to roll back to, or the newest
            self._settle(wait=True)       # at the run's end (Ray reports and prunes it)
        if progress.counters["rollbacks"] == 0:
            try:
                rollback = roll_back(w.training_state, w.run_dir, progress, is_chief=w.is_chief,
                                     weight_decay=t.weight_decay)
            except StorageFailure as failure:  # on every worker: rank 0's read met what no restart fixes
                # Kept as a write's failure is: nothing more is written, and the summary names this read.
                self.chief.failure, self.status = failure, WorkerStatus.STORAGE_FAILED
                return progress
            if rollback is not None:
                back = rollback.progress
                self.chief.write("cutting metrics.jsonl at the rollback", record_rollback, w, progress, rollback,
                            streak)
                self.live.close()
                self.live = _Live.open(w, back)
                # Until the next row, the restored checkpoint's measurements: a checkpoint or summary written
                # sooner would carry the lost steps' values.
                self._measured_as_of(back)
                if self.dashboards is not None:
                    self.dashboards.rewind(back.step)  # the rolled-back steps' points disappear from TensorBoard
                self._eta_from = (back.step, time.perf_counter())
                return back
        self.diagnostic = divergence_report(t, progress.step, lr, result, w.cfg.diffusion.timesteps, streak)
        self.chief.event("diverged", step=progress.step, diagnostic=self.diagnostic)
        if w.is_chief:
            logger.error(f"[raydiff] {self.diagnostic}")
        self.status = WorkerStatus.DIVERGED
        return progress

    def _validate(self, step: int, done: bool) -> float | None:
        """The validation loss, at train.val_every and at the end (with held-out images)."""
        w = self.w
        if w.validation is None or not self._validation_due(step, done):
            return None
        return w.validation.loss(w.ema, w.diffusion, w.device, batch=w.images_per_pass)

    def _evaluate(self, step: int, done: bool) -> dict[str, Any] | None:
        """Sample quality, at eval.every and (eval.at_end) at the end."""
        w = self.w
        if w.quality is None or not self._evaluation_due(step, done):
            return None
        eval_start = time.perf_counter()
        quality = evaluate_in_run(w.quality, w.ema, w.diffusion, w.cfg, w.rank, w.world_size, w.device,
                                  batch=w.images_per_pass)
        quality["eval_s"] = round(time.perf_counter() - eval_start, 2)
        return quality

    def _validation_due(self, step: int, done: bool) -> bool:
        t = self.w.cfg.train
        return self.w.validation is not None and bool((t.val_every and step % t.val_every == 0) or done)

    def _evaluation_due(self, step: int, done: bool) -> bool:
        e = self.w.cfg.eval
        return self.w.quality is not None and bool((e.every and step % e.every == 0) or (done and e.at_end))

    def _extra_metrics(self, val_loss: float | None, quality: dict[str, Any] | None) -> dict[str, Any]:
        """What a metrics row holds besides the window's averages."""
        w = self.w
        extra: dict[str, Any] = {"time_s": round(time.perf_counter() - self.run_start, 3)}
        if w.device.type == "cuda":  # the most allocated since the previous row: a row's own, not the start's
            extra["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(w.device) / 1e9, 3)
            torch.cuda.reset_peak_memory_stats(w.device)
        extra["ema_drift"] = ema_drift(w.ema, w.model)
        if val_loss is not None:
            extra["val_loss"] = val_loss
        if quality is not None:
            extra.update(quality)
        return extra

    def _agree_on_interrupts(self, asked: int) -> str | None:
        """"lease_lost", "stop", "preemption" or None, alike on every worker (a collective of what each was
        `asked`); one checkpoint per preemption notice, not one per check while the notice lasts."""
        interrupt = agreed_interrupt(asked, self.w.device)
        notice = interrupt == "preemption"
        if notice and self._notice_handled:
            interrupt = None  # this notice has its checkpoint already
        self._notice_handled = notice
        return interrupt

    def _checkpoint(self, progress: Progress, report: dict[str, Any]) -> None:
        """Every worker: the window's sums into the progress (a collective); then the checkpoint, written by rank 0
        (`ChiefWrites.checkpoint`)."""
        progress.window = self.live.window.checkpoint_state()
        progress.counters.update(self.live.nonfinite.counters())  # as of this step, not the last check's
        progress.measured = {"val_loss": self.val_loss, "quality": self.quality, "loss": self._final_loss()}
        self.last_checkpoint_step = progress.step
        self.chief.checkpoint(progress, report)
        if self.dashboards is not None:
            self.dashboards.flush()

    def _settle(self, *, wait: bool) -> None:
        """Every worker: rank 0's writes settled (`ChiefWrites.settle`); one no retry can fix ends training."""
        if self.chief.settle(wait=wait):
            self.status = WorkerStatus.STORAGE_FAILED

    def _after_first_step(self, step: int) -> None:
        """After the first step of a start everything the step runs is compiled: rank 0 records how long the step
        took (compilation included), and the worker that keeps the compiled code of its key (rank 0, and with
        several GPUs in a node the first worker on each other GPU index) writes what it newly compiled to the run
        directory (train.compile_cache): rank 0 off the training thread, with the run's other writes."""
        w = self.w
        self.chief.event("first_step", step=step, seconds=round(time.perf_counter() - self.run_start, 3))
        if w.compile_cache is None or not w.compile_cache.keeps or self.chief.failure is not None:
            return
        data = w.compile_cache.artifacts()
        if data is None:
            return
        if w.writes is not None:
            w.writes.submit("the compile cache", w.compile_cache.save, data)
        else:
            w.compile_cache.save_or_warn(data, w.rank)

    def _write_profile(self, step: int) -> None:
        """Rank 0's profile, ended after step `step`: its trace and table to `profile/`, its figures to events.jsonl
        and one line (not training time)."""
        assert self._profile is not None
        w, profile, self._profile = self.w, self._profile, None
        with self._paused():
            try:
                profiled = profile.end(step)
            except Exception as exc:  # noqa: BLE001 - a diagnostic that failed stops nothing: the run goes on
                profile.discard()  # where it failed before stopping the profiler
                logger.warning(f"[raydiff] the profile of steps {profile.first}-{step} failed "
                               f"({type(exc).__name__}: {exc}); training goes on")
                return
            if w.writes is not None and self.chief.failure is None:
                for name, data in ((f"{profiled.name}.pt.trace.json.gz", profiled.trace_gz),
                                   (f"{profiled.name}.txt", profiled.table.encode())):
                    w.writes.submit(name, w.run_dir.write_bytes, name, data)
            self.chief.event("profile", **profiled.figures)
        logger.info(f"[raydiff] profiled steps {profiled.first}-{profiled.last}: {profiled.headline}; "
                    f"{profiled.name}.txt and .pt.trace.json.gz")

    @contextlib.contextmanager
    def _paused(self, due: bool = True) -> Iterator[None]:
        """Time that is not training time, where the block does work (`due`): kept out of the window's img/s. Its
        clock starts when the device has done the steps before (a GPU runs several behind the host: their time is
        training time). A block with nothing due is a few checks on the host, neither timed nor waited for: it
        runs at every step, and a wait there would leave the GPU nothing queued."""
        if not due:
            yield
            return
        synchronize(self.w.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.live.window.paused_s += time.perf_counter() - start


def ray_report(step: int, global_batch: int, quality: dict[str, Any] | None, val_loss: float | None,
               row: dict[str, Any] | None = None) -> dict[str, Any]:
    """What Ray Train, and through it a sweep's Tune, hears at a step: the step, the images seen, the newest
    quality metrics and validation loss, and the step's metrics row if it has one (Tune ranks trials by these
    names)."""
    return {"step": step, "images_seen": step * global_batch, **(quality or {}), **(row or {}),
            **({"val_loss": val_loss} if val_loss is not None else {})}

