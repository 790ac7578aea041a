"""The per-worker DDPM training loop that Ray Train runs on every worker.

Read `train_worker` top to bottom: set up, restore and compile (`raydiff.training.worker`), then one optimizer
step per iteration (`raydiff.training.step`), and what the end of each step calls for (`raydiff.training.cadence`:
the non-finite guard, validation, evaluation, logging, sample grids, interrupts, checkpoints). Progress is counted
in optimizer steps and images seen. The loop is restartable at any checkpoint: after a failure, a resize or a
re-run it continues bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from raydiff.cluster.devices import torch_threads
from raydiff.config.learning_rate import lr_at
from raydiff.model.weight_averages import ema_decay_at
from raydiff.runs.errors import Unresumable
from raydiff.storage.errors import StorageFailure
from raydiff.training.cadence import Cadence
from raydiff.training.lost_workers import quiet_tracebacks_said_in_a_line
from raydiff.training.microbatch import NothingFits
from raydiff.training.step import optimizer_step
from raydiff.training.worker import quiet_ray_train_logs, set_up
from raydiff.training.worker_io import WorkerArgs, WorkerResult, WorkerStatus


def train_worker(loop_config: dict[str, Any]) -> WorkerResult:
    args: WorkerArgs = loop_config["args"]
    cfg = args.config
    t = cfg.train
    torch.set_num_threads(torch_threads(args.cpus_per_worker))  # read here: the worker's environment may cap it
    quiet_ray_train_logs()
    quiet_tracebacks_said_in_a_line()  # a lost worker, or storage beyond its retries, is said by the controller

    # Set up, and restore the newest checkpoint every worker can: on storage, or the one Ray Train hands us.
    # Until then nothing is written: a start the workers refuse leaves the run directory as it was.
    try:
        w, progress = set_up(cfg, args)
    except Unresumable as exc:
        return WorkerResult(WorkerStatus.UNRESUMABLE, steps=0, diagnostic=str(exc))
    except NothingFits as exc:
        return WorkerResult(WorkerStatus.REFUSED, steps=0, diagnostic=str(exc))
    except StorageFailure as exc:  # the newest checkpoint cannot be read, for good: no restart would help
        return WorkerResult(WorkerStatus.STORAGE_FAILED, steps=0, diagnostic=str(exc))
    try:
        cadence = Cadence(w, progress, args)  # rank 0's records of this start, then the logs, grids and checkpoints
    except BaseException:  # its set-up met an error (a peer lost at the first agreement): close what set_up opened
        w.close(flush=False)
        raise

    try:
        while progress.step < t.total_steps and cadence.status is None:
            # Fetch this worker's micro-batches of the step.
            batches = cadence.next_batches(progress.step + 1)

            # One optimizer step.
            lr = lr_at(progress.step, t)
            ema_decay = ema_decay_at(progress.step, t.ema_decay, t.ema_warmup_steps)
            result = optimizer_step(w.step_parts, batches, lr=lr, ema=w.ema_update, ema_decay=ema_decay,
                                    posthoc=w.posthoc, step=progress.step + 1, fault=w.debug.fault(progress.step + 1))
            progress.step += 1

            # What the step's end calls for; a rollback continues from another step.
            progress = cadence.end_of_step(progress, result, lr=lr, ema_decay=ema_decay)
    finally:
        cadence.close()
    return cadence.result(progress)
