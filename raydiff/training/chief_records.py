"""What rank 0 records of a run besides checkpoints: the start records and start line, the metrics rows (with
the dashboards and the progress line), the fixed-seed sample grids, the post-hoc EMA's snapshots, and the record
of a rollback.

Why apart from `raydiff.training.cadence`: the cadence decides when each happens and what a storage failure
stops; these functions say what is written. Each is called through the guard of `raydiff.training.chief_writes`,
which keeps a write that no retry can fix instead of raising, so none of them handles storage errors itself. The
sample grid alone is called directly (it is shown on the dashboards even then): its `storage_ok` says whether
rank 0 may still queue the background write.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from raydiff.config.learning_rate import describe_lr
from raydiff.data.order import rank_share
from raydiff.runs.dashboards import Dashboards
from raydiff.runs.ema_snapshots import (
    SNAPSHOT_DIR,
    describe_snapshots,
    remove_snapshots_after,
    removed_note,
    snapshot_bytes,
    snapshot_name,
)
from raydiff.runs.images import grid_png, image_labels
from raydiff.runs.runlog import progress_line
from raydiff.runs.state import Progress
from raydiff.seeds import GRID_NOISE
from raydiff.training.recovery import Rollback
from raydiff.training.stop import LEASE_LOST, stop_reason
from raydiff.training.worker import Worker
from raydiff.training.worker_io import WorkerArgs

logger = logging.getLogger("raydiff")
GRID_CLASSES = 16  # a class-conditional grid shows at most this many classes, one row each


def record_start(w: Worker, args: WorkerArgs, progress: Progress) -> None:
    """Once the checkpoint is restored: the driver's records of this start, the metrics rows and post-hoc EMA
    snapshots of work that was lost cut off, the start event and the start line. Nothing where the run's lease was
    taken over before this group started: the run is another driver's (the workers stop at their first check)."""
    if stop_reason(args.stop_flag) == LEASE_LOST:
        return
    t = w.cfg.train
    for name, text in args.records.items():
        w.run_dir.write_text(name, text)
    if w.metrics_log is not None:
        w.metrics_log.truncate_after(progress.step)
    forget_snapshots_after(w, progress.step)
    threads = torch.get_num_threads()  # what the worker's CPUs and environment gave (`torch_threads`)
    w.event("start", invocation=args.invocation, step=progress.step, total_steps=t.total_steps,
            world_size=w.world_size, pid=os.getpid(), torch_threads=threads, speed=w.speed.describe(),
            data=w.data_placement, compile_cache=w.compile_cache_note)
    for note in w.restore_notes:
        logger.warning(f"[raydiff] note: {note}")
    share = rank_share(t.global_batch, w.world_size, 0)
    device = f"{w.device}, {threads} torch thread{'s' * (threads > 1)}" if w.device.type == "cpu" else str(w.device)
    extra = f"; {w.compile_cache_note}" if w.compile_cache_note else ""
    extra += f"; {describe_snapshots(w.cfg)}" if w.posthoc is not None else ""
    logger.info(f"[raydiff] {'resuming at step ' + str(progress.step) if progress.step else 'starting'}: "
                f"{w.world_size} worker(s), global batch {t.global_batch} = {share.size} on worker 0 in "
                f"micro-batches of up to {w.micro_batch}, device {device}; {describe_lr(t)}; "
                f"{w.data_placement}; {w.speed.describe()}; {w.memory_plan}{extra}")


def log_row(w: Worker, row: dict[str, Any], dashboards: Dashboards | None, *, start_step: int,
            elapsed_s: float) -> None:
    """A metrics row to metrics.jsonl, the dashboards and the progress line."""
    assert w.metrics_log is not None  # rank 0's
    w.metrics_log.append(row)
    if dashboards is not None:
        dashboards.metrics(row)
    logger.info(progress_line(row, w.cfg.train.total_steps, start_step, elapsed_s))


@torch.no_grad()
def save_sample_grid(w: Worker, step: int, dashboards: Dashboards | None, *, storage_ok: bool) -> None:
    """A fixed-seed DDIM grid from the EMA weights in fp32, in samples/ and on the dashboards. Generated
    `Worker.images_per_pass` images at a time (image i depends on (seed, i) only). A class-conditional run's grid
    has one row per class (the first GRID_CLASSES), at eval.guidance."""
    t, d = w.cfg.train, w.cfg.data
    labels, per_row = grid_labels(w.num_classes, t.sample_num)
    chunks = w.diffusion.sample_in_chunks(
        w.ema, range(len(labels) if labels else t.sample_num), (d.channels, d.resolution, d.resolution),
        batch=w.images_per_pass, seed=t.seed, tag=GRID_NOISE, device=w.device, sampler="ddim", steps=t.sample_steps,
        labels=labels, guidance=w.cfg.eval.guidance)
    png = grid_png(torch.cat(list(chunks)), nrow=per_row)
    if w.writes is not None and storage_ok:
        name = f"samples/step_{step:08d}.png"
        w.writes.submit(name, w.run_dir.write_bytes, name, png)
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


def save_snapshot(w: Worker, step: int) -> None:
    """The post-hoc averages of this step to `ema_snapshots/`, on the background writer (called through
    `ChiefWrites.write`, which calls nothing after a storage failure)."""
    assert w.posthoc is not None and w.writes is not None  # rank 0's, with train.ema: posthoc
    data = snapshot_bytes(w.posthoc, step=step, images_seen=step * w.cfg.train.global_batch,
                          config=w.cfg.to_dict(), classes=w.classes)
    w.writes.submit(snapshot_name(step), w.run_dir.write_bytes, snapshot_name(step), data)


def forget_snapshots_after(w: Worker, step: int) -> None:
    """The post-hoc EMA's snapshots after `step`, where the run continues, removed after the writes queued before
    (a snapshot of a step being rolled back past may still be on its way), with a note that names them."""
    if w.posthoc is None:
        return
    assert w.writes is not None  # rank 0's

    def remove() -> None:
        removed = remove_snapshots_after(w.run_dir, step)
        if removed:
            logger.warning(removed_note(removed, step, "where the run continues (it writes its own as it goes)"))

    w.writes.submit(SNAPSHOT_DIR, remove)


def record_rollback(w: Worker, progress: Progress, rollback: Rollback, streak: int) -> None:
    """metrics.jsonl cut back to the checkpoint, the post-hoc EMA's snapshots too, the rollback event, and the
    warning the user reads (`streak`: the non-finite steps in a row, train.max_bad_steps or more)."""
    back, gb = rollback.progress, w.cfg.train.global_batch
    assert w.metrics_log is not None  # rank 0's
    w.metrics_log.truncate_after(back.step)
    forget_snapshots_after(w, back.step)
    w.event("rollback", from_step=progress.step, to_step=back.step, checkpoint=str(rollback.checkpoint),
            skipped_positions=[rollback.failed_from * gb, back.stream_step * gb])
    logger.warning(f"[raydiff] WARNING: {streak} non-finite steps in a row at step "
                   f"{progress.step}: rolled back to step {back.step} and skipped the {progress.step - back.step} "
                   f"steps of data that failed")
