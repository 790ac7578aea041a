"""The per-worker DDPM training loop that Ray Train runs on every worker.

Read `train_worker` top to bottom: set up, restore and compile (`raydiff.training.worker`), then one optimizer step per
iteration (`raydiff.training.step`), the non-finite-streak guard (`raydiff.training.recovery`), and the cadences:
validate, evaluate, log, sample, checkpoint. Progress is counted in optimizer steps and images seen. The loop is
restartable at any checkpoint: after a failure, a resize or a re-run it continues bit for bit.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch

from raydiff.config import Config
from raydiff.config.lr_rule import describe_lr
from raydiff.data.loader import BatchStream
from raydiff.data.order import rank_share
from raydiff.model.ema import ema_decay_at
from raydiff.model.noise import GRID_NOISE
from raydiff.runs.checkpoint import checkpoint_name, write_state
from raydiff.runs.dashboards import Dashboards, dashboards_for
from raydiff.runs.images import grid_png, image_labels
from raydiff.runs.runlog import progress_line
from raydiff.runs.state import Progress, Unresumable, checkpoint_state
from raydiff.training.distributed import interrupt_requested
from raydiff.training.in_run_quality import ema_drift, evaluate_in_run
from raydiff.training.lr import lr_at
from raydiff.training.recovery import divergence_report, roll_back
from raydiff.training.step import optimizer_step
from raydiff.training.window import MetricsWindow, NonFiniteSteps
from raydiff.training.worker import Worker, quiet_ray_train_logs, set_up
from raydiff.training.worker_io import WorkerArgs, WorkerResult, WorkerStatus

logger = logging.getLogger("raydiff")
GRID_CLASSES = 16  # a class-conditional grid shows at most this many classes, one row each
CHECK_EVERY_STEPS = 10  # how often the workers look at the device's counters and agree on stop / preemption


def train_worker(loop_config: dict[str, Any]) -> WorkerResult:
    args: WorkerArgs = loop_config["args"]
    cfg = Config.from_dict(args.config)
    t = cfg.train
    torch.set_num_threads(args.torch_threads)
    quiet_ray_train_logs()
    # Set up and resume from the newest checkpoint that restores: on storage, or the one Ray Train hands us.
    # Until then nothing is written: a start the workers refuse leaves the run directory as it was.
    try:
        w, progress = set_up(cfg, args)
    except Unresumable as exc:
        return WorkerResult(WorkerStatus.UNRESUMABLE, steps=0, diagnostic=str(exc))
    start_step = progress.step
    if w.is_chief:
        _record_start(w, args, progress)
    live = _Live.open(w, progress)
    interrupts = _Interrupts(args.stop_flag, w)
    last_row: dict[str, Any] | None = None  # the newest metrics row
    val_loss: float | None = None
    quality: dict[str, Any] | None = None  # the newest evaluation's metrics
    last_checkpoint_step, diagnostic, status = progress.step, None, WorkerStatus.FINISHED
    run_start = time.perf_counter()
    try:
        while progress.step < t.total_steps:
            # Fetch this worker's micro-batches of the step.
            wait_start = time.perf_counter()
            batches = next(live.stream)
            data_wait_s = time.perf_counter() - wait_start
            w.debug.before_step(progress.step + 1, batches)

            # One optimizer step.
            lr = lr_at(progress.step, w.lr, t.warmup_steps)
            ema_decay = ema_decay_at(progress.step + 1, t.ema_decay, t.ema_warmup_steps)
            result = optimizer_step(w.step_inputs, batches, lr=lr, ema=w.ema_update, ema_decay=ema_decay,
                                    fault=w.debug.fault(progress.step + 1))
            progress.step += 1
            step, done = progress.step, progress.step == t.total_steps
            if step == start_step + 1:
                _after_first_step(w, step, time.perf_counter() - run_start)
            live.window.add(result, data_wait_s)
            live.nonfinite.add(result.finite)
            check = step % CHECK_EVERY_STEPS == 0 or done  # the device's counters are read only here
            if check or step % t.log_every == 0:
                progress.counters["skipped_steps"] = live.nonfinite.skipped_steps()

            # Too many non-finite steps in a row: roll back past them once, then give up.
            if check and live.nonfinite.longest_streak() >= t.max_bad_steps:
                rolled_back = roll_back(w, progress) if progress.counters["rollbacks"] == 0 else None
                if rolled_back is not None:
                    progress = rolled_back
                    live.close()
                    live = _Live.open(w, progress)  # the rolled-back steps' dashboard points disappear
                    continue
                diagnostic = divergence_report(t, step, lr, result, cfg.diffusion.timesteps)
                w.event("diverged", step=step, diagnostic=diagnostic)
                if w.is_chief:
                    logger.error(f"[raydiff] {diagnostic}")
                status = WorkerStatus.DIVERGED
                break

            # Validate and evaluate at their cadences (the same decision on every worker; not training time).
            pause_start = time.perf_counter()
            new_val_loss, new_quality = _validate(w, step, done), _evaluate(w, step, done)
            measured = new_val_loss is not None or new_quality is not None
            val_loss = new_val_loss if new_val_loss is not None else val_loss
            quality = new_quality if new_quality is not None else quality
            live.window.paused_s += time.perf_counter() - pause_start

            # Log, sample, checkpoint (sampling and checkpointing are not training time either).
            row = None
            if step % t.log_every == 0 or done or measured:
                row = live.window.close(step=step, global_batch=t.global_batch, lr=lr, ema_decay=ema_decay,
                                        world_size=w.world_size, skipped_steps=progress.counters["skipped_steps"])
                last_row = row = row | _extra_metrics(w, run_start, new_val_loss, new_quality)
                _log_row(w, live.dashboards, row, start_step, run_start)
            pause_start = time.perf_counter()
            if w.is_chief and ((t.sample_every and step % t.sample_every == 0) or done):
                _save_sample_grid(w, step, live.dashboards)
            interrupt = interrupts.poll(step) if check and not done else None
            # Ray sees checkpoints, validation losses and quality metrics (Tune stops trials on them). Other rows go
            # to metrics.jsonl only: each report waits for Ray Train's controller to poll it.
            report = {"step": step, "images_seen": step * t.global_batch, **(quality or {}), **(row or {}),
                      **({"val_loss": val_loss} if val_loss is not None else {})}
            if step % t.checkpoint_every == 0 or done or (interrupt and last_checkpoint_step != step):
                if interrupt:
                    w.event(f"{interrupt}_checkpoint", step=step)
                _report_checkpoint(w, report, progress, live)
                last_checkpoint_step = step
            elif measured:
                ray.train.report(report, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            live.window.paused_s += time.perf_counter() - pause_start
            if interrupt == "stop":
                status = WorkerStatus.STOPPED
                break
    finally:
        w.close()
        live.close()

    return WorkerResult(status, steps=progress.step, diagnostic=diagnostic, images_seen=progress.step * t.global_batch,
                        final_loss=last_row["loss"] if last_row else None, val_loss=val_loss, quality=quality,
                        skipped_steps=progress.counters["skipped_steps"], rollbacks=progress.counters["rollbacks"],
                        world_size=w.world_size, resumed_from_step=start_step)


@dataclass
class _Live:
    """What the loop reopens after a rollback: the sample stream, the logging window, the non-finite counter and
    rank 0's dashboards (reopened so that the rolled-back steps' points disappear)."""

    stream: BatchStream
    window: MetricsWindow
    nonfinite: NonFiniteSteps
    dashboards: Dashboards | None

    @classmethod
    def open(cls, w: Worker, progress: Progress) -> _Live:
        return cls(stream=w.open_stream(progress), window=MetricsWindow(w.device, progress.window, w.is_chief),
                   nonfinite=NonFiniteSteps(w.device, progress.counters["skipped_steps"]),
                   # TensorBoard / MLflow / W&B; points past the checkpoint (lost work) are hidden on TensorBoard.
                   dashboards=dashboards_for(w.cfg, w.run_dir, resume_step=progress.step) if w.is_chief else None)

    def close(self) -> None:
        if self.dashboards is not None:
            self.dashboards.close()
        self.stream.close()


def _record_start(w: Worker, args: WorkerArgs, progress: Progress) -> None:
    """Rank 0, once the checkpoint is restored: the driver's records of this start, the metrics rows of work that
    was lost cut off, the start event and the start line."""
    t = w.cfg.train
    for name, text in args.records.items():
        w.run_dir.write_text(name, text)
    if w.metrics_log is not None:
        w.metrics_log.truncate_after(progress.step)
    w.event("start", invocation=args.invocation, step=progress.step, world_size=w.world_size, pid=os.getpid(),
            speed=w.speed.describe(), compile_cache=w.compile_cache_note)
    for note in w.restore_notes:
        logger.warning(f"[raydiff] note: {note}")
    share = rank_share(t.global_batch, w.world_size, 0)
    cache = f"; {w.compile_cache_note}" if w.compile_cache_note else ""
    logger.info(f"[raydiff] {'resuming at step ' + str(progress.step) if progress.step else 'starting'}: "
                f"{w.world_size} worker(s), global batch {t.global_batch} = {share.size} on worker 0 in "
                f"micro-batches of up to {w.micro_batch}, device {w.device}; {describe_lr(t)}; "
                f"{w.speed.describe()}; {w.memory_plan}{cache}")


def _after_first_step(w: Worker, step: int, seconds: float) -> None:
    """After the first step of a start everything the step runs is compiled: rank 0 records how long the step took
    (compilation included) and keeps what was newly compiled in the run directory (train.compile_cache), off the
    training thread."""
    w.event("first_step", step=step, seconds=round(seconds, 3))
    if w.compile_cache is None or w.writes is None:
        return
    data = w.compile_cache.artifacts()
    if data is not None:
        w.writes.submit(w.compile_cache.save, data)


class _Interrupts:
    """Whether the workers stop, or checkpoint for a preemption notice: one checkpoint per notice, not one per
    check while the notice lasts."""

    def __init__(self, stop_flag: ray.actor.ActorHandle | None, w: Worker) -> None:
        self._stop_flag, self._w = stop_flag, w
        self._notice_handled = False

    def poll(self, step: int) -> str | None:
        """"stop", "preemption" or None; a collective: every worker calls it at the same steps."""
        w = self._w
        interrupt = interrupt_requested(self._stop_flag, w.is_chief, w.device, w.debug.preemption_notice(step))
        notice = interrupt == "preemption"
        if notice and self._notice_handled:
            interrupt = None  # this notice has its checkpoint already
        self._notice_handled = notice
        return interrupt


def _validate(w: Worker, step: int, done: bool) -> float | None:
    """The validation loss, at train.val_every and at the end (with held-out images)."""
    t = w.cfg.train
    if w.validation is None or not ((t.val_every and step % t.val_every == 0) or done):
        return None
    return w.validation.loss(w.ema, w.diffusion, w.device)


def _evaluate(w: Worker, step: int, done: bool) -> dict[str, Any] | None:
    """Sample quality, at eval.every and (eval.at_end) at the end."""
    e = w.cfg.eval
    if w.quality is None or not ((e.every and step % e.every == 0) or (done and e.at_end)):
        return None
    eval_start = time.perf_counter()
    quality = evaluate_in_run(w.quality, w.ema, w.diffusion, w.cfg, w.rank, w.world_size, w.device,
                              batch=w.micro_batch)
    quality["eval_s"] = round(time.perf_counter() - eval_start, 2)
    return quality


def _extra_metrics(w: Worker, run_start: float, val_loss: float | None,
                   quality: dict[str, Any] | None) -> dict[str, Any]:
    """What a metrics row holds besides the window's averages."""
    extra: dict[str, Any] = {"time_s": round(time.perf_counter() - run_start, 3)}
    if w.device.type == "cuda":
        extra["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(w.device) / 1e9, 3)
    extra["ema_drift"] = ema_drift(w.ema, w.model)
    if val_loss is not None:
        extra["val_loss"] = val_loss
    if quality is not None:
        extra.update(quality)
    return extra


def _log_row(w: Worker, dashboards: Dashboards | None, metrics: dict[str, Any], start_step: int,
             run_start: float) -> None:
    """Rank 0: the row to metrics.jsonl, the dashboards and the progress line."""
    if w.metrics_log is None:
        return
    w.metrics_log.append(metrics)
    if dashboards is not None:
        dashboards.metrics(metrics)
    logger.info(progress_line(metrics, w.cfg.train.total_steps, start_step, time.perf_counter() - run_start))


@torch.no_grad()
def _save_sample_grid(w: Worker, step: int, dashboards: Dashboards | None) -> None:
    """A fixed-seed DDIM grid from the EMA weights in fp32, in samples/ and on the dashboards. Generated a
    micro-batch at a time: what fits a training step fits sampling (image i depends on (seed, i) only). A
    class-conditional run's grid has one row per class (the first GRID_CLASSES), at eval.guidance."""
    t, d = w.cfg.train, w.cfg.data
    labels, per_row = grid_labels(w.num_classes, t.sample_num)
    chunks = w.diffusion.sample_in_chunks(
        w.ema, range(len(labels) if labels else t.sample_num), (d.channels, d.resolution, d.resolution),
        batch=w.micro_batch, seed=t.seed, tag=GRID_NOISE, device=w.device, sampler="ddim", steps=t.sample_steps,
        labels=labels, guidance=w.cfg.eval.guidance)
    png = grid_png(torch.cat(list(chunks)), nrow=per_row)
    if w.writes is not None:
        w.writes.submit(w.run_dir.write_bytes, f"samples/step_{step:08d}.png", png)
    if dashboards is not None:
        dashboards.image("samples", png, step)


def grid_labels(num_classes: int, sample_num: int) -> tuple[list[int] | None, int | None]:
    """(the class of each grid image, images per row): one row per class of a class-conditional model, as many
    images per row as `sample_num` allows (at least one); (None, None) for an unconditional model."""
    if not num_classes:
        return None, None
    shown = min(num_classes, GRID_CLASSES)
    per_row = max(1, sample_num // shown)
    return image_labels(range(shown), shown * per_row), per_row  # raydiff.sample's blocks: it reproduces the grid


def _report_checkpoint(w: Worker, metrics: dict[str, Any], progress: Progress, live: _Live) -> None:
    """Report with a checkpoint: the chief writes the full state, every worker takes part in the report.
    Ray uploads it in the background and deletes the local copy, so training goes on at once. The dashboards
    are flushed with it."""
    progress.window = live.window.checkpoint_state()  # a collective: the window's sums over all workers
    checkpoint = None
    if w.metrics_log is not None and w.writes is not None:  # rank 0
        w.metrics_log.flush()  # the rows up to this checkpoint are kept on resume: on storage before it
        w.writes.drain()
        directory = Path(tempfile.mkdtemp(prefix="raydiff-ckpt-"))
        write_state(directory, checkpoint_state(w.training_state, progress, w.cfg.train.global_batch,
                                                w.cfg.to_dict(), w.classes))
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(progress.step, w.run_dir),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
    if live.dashboards is not None:
        live.dashboards.flush()
