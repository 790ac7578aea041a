"""The per-worker DDPM training loop that Ray Train runs on every worker.

Read it top to bottom: build, resume, then one optimizer step per iteration (accumulate over this worker's
micro-batches with the all-reduce only on the last one, unscale, clip, skip non-finite steps, update EMA),
then log / sample / checkpoint at their cadences. Progress is counted in optimizer steps and images seen.
The loop is restartable at any checkpoint: after a failure, a resize or a re-run it continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raydiff.config import Config
from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.order import SampleOrder, derive_seed, rank_share
from raydiff.model.diffusion import build_diffusion
from raydiff.model.ema import ema_decay_at, make_ema, update_ema
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import checkpoint_name, write_state
from raydiff.runs.images import grid_png
from raydiff.runs.rundir import RunDir
from raydiff.runs.runlog import JsonlLog, progress_line
from raydiff.runs.state import Progress, checkpoint_candidates, restore_newest, training_state
from raydiff.training.lr import describe_lr, lr_at
from raydiff.training.microbatch import measure_micro_batch
from raydiff.training.stop import stop_reason
from raydiff.training.validation import Validation, holdout_split

logger = logging.getLogger("raydiff")
INTERRUPT_CHECK_STEPS = 10  # how often the workers agree on whether to checkpoint now (preemption, stop request)
REMOTE_METRICS_FLUSH_S = 30.0  # an object store cannot append: metrics.jsonl is rewritten at most this often


def quiet_ray_train_logs() -> None:
    """Ray 2.60 names some Train loggers by file path (`getLogger(__file__)`), so they escape RunConfig's
    LoggingConfig and print every report on every worker; raise just those to WARNING."""
    for name in list(logging.root.manager.loggerDict):
        if "ray/train/" in name.replace("\\", "/"):
            logging.getLogger(name).setLevel(logging.WARNING)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32. auto = bf16 on GPUs that support it, else fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def _from_rank_zero(value: Any) -> Any:
    """Every worker takes rank 0's value (a decision that must be the same everywhere)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _interrupt(stop_flag, is_chief: bool, device: torch.device) -> str | None:
    """Whether to checkpoint now, decided alike on every worker: "stop" when the driver was asked to stop (rank 0
    asks it), "preemption" when any worker's node is about to be reclaimed, else None."""
    preempted = ray.train.get_preemption_info() is not None  # a collective itself: every rank must call it
    local = 2 if is_chief and stop_reason(stop_flag) else 1 if preempted else 0
    if dist.is_available() and dist.is_initialized():
        box = torch.tensor(local, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        local = int(box)
    return {0: None, 1: "preemption", 2: "stop"}[local]


def _smallest(value: int, device: torch.device) -> int:
    """The smallest of every worker's value."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = torch.tensor(value, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box)


def train_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    cfg = Config.from_dict(loop_config["config"])
    t = cfg.train
    run_dir: RunDir = loop_config["run_dir"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    is_chief = rank == 0
    torch.set_num_threads(loop_config["torch_threads"])
    quiet_ray_train_logs()

    # Build the model, its EMA, the optimizer and the loss scaler.
    torch.manual_seed(t.seed)  # identical initial weights on every worker
    model = build_model(cfg).to(device)
    ema = make_ema(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    autocast_dtype = resolve_precision(t.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    diffusion = build_diffusion(cfg)
    objects = (model, ema, optimizer, scaler)

    # Resume from the newest readable checkpoint: on storage, or the one Ray Train hands us.
    latest = ray.train.get_checkpoint()  # rank 0 lists storage once, every worker restores what it found
    candidates = _from_rank_zero(checkpoint_candidates(run_dir, latest) if is_chief else None)
    progress, _ = restore_newest(candidates, *objects)
    start_step = progress.step
    ddp_model = ray.train.torch.prepare_model(model)
    is_ddp = isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)

    # Split off the held-out images and open this worker's stream of micro-batches at the resume point.
    store, share = loop_config["images"], rank_share(t.global_batch, world_size, rank)
    table = ImageTable(store.arrays())
    train_indices, val_indices = holdout_split(store.usable_indices(), cfg.data.val_images, t.seed)
    order = SampleOrder(train_indices, t.seed)
    validation = Validation(table=table, val_indices=val_indices, seed=t.seed, timesteps=diffusion.timesteps,
                            rank=rank, world_size=world_size) if len(val_indices) else None
    if t.micro_batch == "auto":
        micro_batch = _smallest(measure_micro_batch(model, diffusion, optimizer, share=share.size, shape=store.shape,
                                                    device=device, autocast_dtype=autocast_dtype), device)
    else:
        micro_batch = cfg.micro_batch_for(world_size)

    def open_stream(step: int) -> BatchStream:
        return BatchStream(table=table, order=order, global_batch=t.global_batch, share=share,
                           micro_batch=micro_batch, start_step=step, pin_memory=device.type == "cuda")

    stream = open_stream(progress.step)
    metrics_log = JsonlLog(run_dir, "metrics.jsonl", flush_every_s=REMOTE_METRICS_FLUSH_S) if is_chief else None
    events = JsonlLog(run_dir, "events.jsonl") if is_chief else None
    order_log = _order_log(run_dir, rank) if cfg.debug.record_order else None
    if is_chief:
        metrics_log.truncate_after(progress.step)  # rows past the checkpoint belong to lost work
        events.append({"event": "start", "invocation": loop_config["invocation"], "step": progress.step,
                       "world_size": world_size, "pid": os.getpid(), "time": time.time()})
        logger.info(f"[raydiff] {'resuming at step ' + str(progress.step) if progress.step else 'starting'}: "
                    f"{world_size} worker(s), global batch {t.global_batch} = {share.size} on worker 0 in "
                    f"micro-batches of up to {micro_batch}, device {device}; {describe_lr(t)}")

    window = _open_window(progress, device)
    injected_nan_steps: set[int] = set()
    bad_streak, last_row, last_checkpoint_step, diagnostic = 0, None, progress.step, None
    val_loss, val_step, stopped = None, None, False
    run_start = time.perf_counter()
    try:
        while progress.step < t.total_steps:
            step = progress.step
            lr = lr_at(step, t.lr, t.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Fetch this worker's micro-batches of the step.
            wait_start = time.perf_counter()
            batches = next(stream)
            window["data_wait_s"] += time.perf_counter() - wait_start
            if cfg.debug.step_delay_s:
                time.sleep(cfg.debug.step_delay_s)
            if order_log is not None:
                order_log.write(json.dumps({"step": step + 1, "positions": [batches[0].position,
                                            batches[-1].position + len(batches[-1].images)],
                                            "indices": [int(i) for b in batches for i in b.indices]}) + "\n")

            # Accumulate gradients; all-reduce only on the last micro-batch.
            ddp_model.train()
            for i, batch in enumerate(batches):
                x0 = batch.to_device(device, cfg.data.flip)
                timesteps, noise = batch.diffusion_inputs(t.seed, diffusion.timesteps, device)
                torch.manual_seed(derive_seed(t.seed, batch.position))  # dropout
                sync = not is_ddp or i == len(batches) - 1
                with contextlib.nullcontext() if sync else ddp_model.no_sync():
                    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                        losses = diffusion.loss_per_sample(ddp_model, x0, timesteps, noise)
                    if is_chief and step + 1 in cfg.debug.nan_at_steps and step + 1 not in injected_nan_steps:
                        injected_nan_steps.add(step + 1)  # a transient fault: once per step number
                        losses = losses * float("nan")
                    # Sum over samples, scaled so DDP's average over workers gives the global-batch mean.
                    scaler.scale(losses.sum() * (world_size / t.global_batch)).backward()
                window["loss_sum"] += losses.detach().float().sum()
                window["samples"] += len(x0)

            # Unscale, clip, and skip the step if anything is not finite.
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
            finite = bool(torch.isfinite(grad_norm))  # gradients are all-reduced: every worker agrees
            if finite or scaler.is_enabled():
                scaler.step(optimizer)  # the scaler skips non-finite steps itself
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            step = progress.step

            # Update the EMA, once per optimizer step, on every worker.
            ema_decay = ema_decay_at(step, t.ema_decay, t.ema_warmup_steps)
            if finite:
                update_ema(ema, model, ema_decay)
                window["grad_norm_sum"] += float(grad_norm)
                window["finite_steps"] += 1
                bad_streak = 0
            else:
                progress.counters["skipped_steps"] += 1
                bad_streak += 1
            window["steps"] += 1

            # Too many non-finite steps in a row: roll back to the last good checkpoint once, then give up.
            if bad_streak >= t.max_bad_steps:
                first_time = progress.counters["rollbacks"] == 0
                candidates = _from_rank_zero(checkpoint_candidates(run_dir) if is_chief else None) if first_time else []
                restored_progress, restored = restore_newest(candidates, *objects) if candidates else (None, None)
                if restored is not None:
                    restored_progress.counters["rollbacks"] = 1
                    progress = restored_progress
                    stream.close()
                    stream, window, bad_streak = open_stream(progress.step), _open_window(progress, device), 0
                    if is_chief:
                        metrics_log.truncate_after(progress.step)
                        events.append({"event": "rollback", "from_step": step, "to_step": progress.step,
                                       "checkpoint": str(restored), "time": time.time()})
                        logger.warning(f"[raydiff] WARNING: {t.max_bad_steps} non-finite steps in a row at step "
                                       f"{step}: rolled back to step {progress.step}")
                    continue
                diagnostic = _divergence_report(t, step, lr, grad_norm, x0, timesteps, losses, diffusion.timesteps)
                if is_chief:
                    events.append({"event": "diverged", "step": step, "diagnostic": diagnostic, "time": time.time()})
                    logger.error(f"[raydiff] {diagnostic}")
                break

            # Validate, log, sample and checkpoint at their cadences (the same decision on every worker).
            done = step == t.total_steps
            if validation is not None and ((t.val_every and step % t.val_every == 0) or done):
                val_start = time.perf_counter()
                val_loss, val_step = validation.loss(ema, diffusion, device), step
                window["paused_s"] += time.perf_counter() - val_start
            metrics = None
            if step % t.log_every == 0 or done or val_step == step:
                metrics = _close_window(window, progress, t, lr, ema_decay, world_size, device)
                metrics["time_s"] = round(time.perf_counter() - run_start, 3)
                if val_step == step:
                    metrics["val_loss"] = val_loss
                last_row = metrics
                if is_chief:
                    metrics_log.append(metrics)
                    logger.info(progress_line(metrics, t.total_steps, start_step, time.perf_counter() - run_start))
            pause_start = time.perf_counter()  # sampling and checkpointing do not count as training time
            if is_chief and ((t.sample_every and step % t.sample_every == 0) or done):
                _save_sample_grid(ema, diffusion, cfg, step, run_dir, device)
            interrupt = _interrupt(loop_config.get("stop_flag"), is_chief, device) \
                if step % INTERRUPT_CHECK_STEPS == 0 and not done else None
            # Ray sees checkpoints and validation losses (Tune stops trials on them). Other metrics rows go to
            # metrics.jsonl only: each report waits for Ray Train's controller to poll it (every 2 s).
            report = {"step": step, "images_seen": step * t.global_batch, **(metrics or {}),
                      **({"val_loss": val_loss} if val_loss is not None else {})}
            if step % t.checkpoint_every == 0 or done or (interrupt and last_checkpoint_step != step):
                if interrupt and is_chief:
                    events.append({"event": f"{interrupt}_checkpoint", "step": step, "time": time.time()})
                if is_chief:
                    metrics_log.flush()  # the rows up to this checkpoint are kept on resume
                _report_checkpoint(report, objects, progress, window, cfg, is_chief, run_dir)
                last_checkpoint_step = step
            elif val_step == step:
                ray.train.report(report, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            window["paused_s"] += time.perf_counter() - pause_start
            if interrupt == "stop":
                stopped = True
                break
    finally:
        if is_chief:
            metrics_log.flush()
        stream.close()
        if order_log is not None:
            order_log.close()

    status = "diverged" if diagnostic else "stopped" if stopped else "finished"
    return {"status": status, "diagnostic": diagnostic, "steps": progress.step,
            "images_seen": progress.step * t.global_batch, "final_loss": last_row and last_row["loss"],
            "skipped_steps": progress.counters["skipped_steps"], "rollbacks": progress.counters["rollbacks"],
            "world_size": world_size, "resumed_from_step": start_step, "val_loss": val_loss}


def _order_log(run_dir: RunDir, rank: int):
    """Audit trail of the samples this worker trains on (debug.record_order; a local run.storage only)."""
    folder = run_dir.local / "order"
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"rank{rank}_pid{os.getpid()}.jsonl", "a", buffering=1)


def _open_window(progress: Progress, device: torch.device) -> dict[str, Any]:
    """A logging window, continuing the partial sums saved with the checkpoint."""
    saved = progress.window
    return {"loss_sum": torch.tensor(float(saved["loss_sum"]), device=device), "samples": saved["samples"],
            "grad_norm_sum": saved["grad_norm_sum"], "finite_steps": saved["finite_steps"],
            "data_wait_s": 0.0, "steps": 0, "paused_s": 0.0, "start": time.perf_counter()}


def _close_window(window, progress: Progress, t, lr, ema_decay, world_size, device) -> dict[str, Any]:
    """Average the window's statistics over all workers, reset the window, return one metrics row."""
    elapsed = time.perf_counter() - window["start"] - window["paused_s"]
    totals = torch.stack([window["loss_sum"].float(), torch.tensor(float(window["samples"]), device=device),
                          torch.tensor(window["data_wait_s"] / max(elapsed, 1e-9), device=device)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, samples, wait_frac_sum = totals.tolist()
    row = {
        "step": progress.step,
        "images_seen": progress.step * t.global_batch,
        "loss": loss_sum / max(samples, 1),
        "grad_norm": window["grad_norm_sum"] / window["finite_steps"] if window["finite_steps"] else float("nan"),
        "lr": lr,
        "ema_decay": ema_decay,
        "images_per_s": window["steps"] * t.global_batch / max(elapsed, 1e-9),
        "data_wait_frac": wait_frac_sum / world_size,
        "world_size": world_size,
        "skipped_steps": progress.counters["skipped_steps"],
    }
    window.update(_open_window(Progress(), device))
    return row


def _divergence_report(t, step, lr, grad_norm, x0, timesteps, losses, num_timesteps) -> str:
    """One line that says what was going on when training diverged, so the user can act on it."""
    buckets = []
    for q in range(4):
        low, high = q * num_timesteps // 4, (q + 1) * num_timesteps // 4
        selected = losses.detach().float()[(timesteps >= low) & (timesteps < high)]
        mean = f"{selected.mean().item():.4g}" if len(selected) else "-"
        buckets.append(f"t {low}-{high - 1}: {mean}")
    return (f"training diverged: {t.max_bad_steps} non-finite steps in a row at step {step} (rolled back at most "
            f"once before); lr {lr:.3g}, grad norm {float(grad_norm):.3g}, input range [{x0.min().item():.3g}, "
            f"{x0.max().item():.3g}], loss by timestep ({'; '.join(buckets)}). Try a lower train.lr, more "
            f"train.warmup_steps, train.grad_clip, or train.precision=fp32/bf16.")


@torch.no_grad()
def _save_sample_grid(ema, diffusion, cfg: Config, step: int, run_dir: RunDir, device) -> None:
    """A fixed-seed DDIM grid from the EMA weights in fp32."""
    t, d = cfg.train, cfg.data
    images = diffusion.sample(ema, (t.sample_num, d.channels, d.resolution, d.resolution), sampler="ddim",
                              steps=t.sample_steps, generator=torch.Generator().manual_seed(t.seed), device=device)
    run_dir.write_bytes(f"samples/step_{step:08d}.png", grid_png(images))


def _report_checkpoint(metrics, objects, progress: Progress, window, cfg: Config, is_chief: bool,
                       run_dir: RunDir) -> None:
    """Report with a checkpoint: the chief writes the full state, every worker takes part in the report.
    Ray uploads it in the background and deletes the local copy, so training goes on at once."""
    checkpoint = None
    if is_chief:
        progress.window = {"loss_sum": float(window["loss_sum"]), "samples": window["samples"],
                           "grad_norm_sum": window["grad_norm_sum"], "finite_steps": window["finite_steps"]}
        directory = Path(tempfile.mkdtemp(prefix="raydiff-ckpt-"))
        write_state(directory, training_state(*objects, progress, cfg.train.global_batch, cfg.to_dict()))
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(progress.step, run_dir),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
