"""The per-worker DDPM training loop that Ray Train runs on every worker.

Read it top to bottom: build, resume, then one optimizer step per iteration (accumulate over this worker's
micro-batches with the all-reduce only on the last one, unscale, clip, skip non-finite steps, update EMA),
then log / sample / checkpoint at their cadences. Progress is counted in optimizer steps and images seen.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raydiff.checkpoint import checkpoint_name, read_state, write_state
from raydiff.config import Config
from raydiff.diffusion import build_diffusion
from raydiff.ema import ema_decay_at, make_ema, update_ema
from raydiff.images import save_grid
from raydiff.loader import BatchStream, ImageTable
from raydiff.order import SampleOrder, derive_seed, rank_share
from raydiff.runlog import MetricsLog, progress_line
from raydiff.unet import build_model

logger = logging.getLogger("raydiff")


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


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then constant (as in DDPM)."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr


def training_state(model, ema, optimizer, scaler, cfg: Config, step: int, counters: dict[str, int]) -> dict[str, Any]:
    return {
        "model": model.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "step": step, "images_seen": step * cfg.train.global_batch,
        "counters": dict(counters), "config": cfg.to_dict(),
    }


def train_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    cfg = Config.from_dict(loop_config["config"])
    t = cfg.train
    run_dir = Path(loop_config["run_dir"])
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

    # Resume from the latest checkpoint Ray Train hands us, if any.
    step, counters = 0, {"skipped_steps": 0}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = read_state(Path(directory))
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step, counters = state["step"], dict(state["counters"])
    start_step = step
    ddp_model = ray.train.torch.prepare_model(model)
    is_ddp = isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)

    # Open this worker's stream of micro-batches at the resume point.
    store = loop_config["images"]
    share = rank_share(t.global_batch, world_size, rank)
    stream = BatchStream(
        table=ImageTable(store.arrays()), order=SampleOrder(store.num_images, t.seed), global_batch=t.global_batch,
        share=share, micro_batch=cfg.micro_batch_for(world_size), start_step=step, timesteps=diffusion.timesteps,
        pin_memory=device.type == "cuda",
    )
    log = MetricsLog(run_dir / "metrics.jsonl") if is_chief else None
    if log is not None:
        log.truncate_after(step)  # rows past the checkpoint belong to lost work
        logger.info(f"[raydiff] {'resuming at step ' + str(step) if step else 'starting'}: {world_size} worker(s), "
                    f"global batch {t.global_batch} = {share.size} per worker in micro-batches of "
                    f"{cfg.micro_batch_for(world_size)}, device {device}")

    window = {"loss_sum": torch.zeros((), device=device), "samples": 0, "grad_norm_sum": 0.0, "finite_steps": 0,
              "data_wait_s": 0.0, "steps": 0, "paused_s": 0.0, "start": time.perf_counter()}
    run_start, last_row = time.perf_counter(), None
    try:
        while step < t.total_steps:
            lr = lr_at(step, t.lr, t.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Fetch this worker's micro-batches of the step.
            wait_start = time.perf_counter()
            batches = next(stream)
            window["data_wait_s"] += time.perf_counter() - wait_start

            # Accumulate gradients; all-reduce only on the last micro-batch.
            ddp_model.train()
            for i, batch in enumerate(batches):
                x0 = batch.to_device(device, cfg.data.flip)
                timesteps, noise = batch.diffusion_inputs(device)
                torch.manual_seed(derive_seed(t.seed, batch.position))  # dropout
                sync = not is_ddp or i == len(batches) - 1
                with contextlib.nullcontext() if sync else ddp_model.no_sync():
                    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                        losses = diffusion.loss_per_sample(ddp_model, x0, timesteps, noise)
                    # Sum over samples, scaled so DDP's average over workers gives the global-batch mean.
                    scaler.scale(losses.sum() * (world_size / t.global_batch)).backward()
                window["loss_sum"] += losses.detach().sum()
                window["samples"] += len(x0)

            # Unscale, clip, and skip the step if anything is not finite.
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
            finite = bool(torch.isfinite(grad_norm))
            if finite or scaler.is_enabled():
                scaler.step(optimizer)  # the scaler skips non-finite steps itself
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Update the EMA, once per optimizer step, on every worker.
            ema_decay = ema_decay_at(step, t.ema_decay, t.ema_warmup_steps)
            if finite:
                update_ema(ema, model, ema_decay)
                window["grad_norm_sum"] += float(grad_norm)
                window["finite_steps"] += 1
            else:
                counters["skipped_steps"] += 1
            window["steps"] += 1

            # Log, sample and checkpoint at their cadences (the same decision on every worker).
            done = step == t.total_steps
            metrics = None
            if step % t.log_every == 0 or done:
                metrics = _window_metrics(window, step, t, lr, ema_decay, world_size, counters, device)
                metrics["time_s"] = round(time.perf_counter() - run_start, 3)
                last_row = metrics
                if log is not None:
                    log.append(metrics)
                    logger.info(progress_line(metrics, t.total_steps, start_step, time.perf_counter() - run_start))
            pause_start = time.perf_counter()  # sampling and checkpointing do not count as training time
            if is_chief and ((t.sample_every and step % t.sample_every == 0) or done):
                _save_sample_grid(ema, diffusion, cfg, step, run_dir, device)
            if step % t.checkpoint_every == 0 or done:
                _report_checkpoint(metrics or {"step": step}, model, ema, optimizer, scaler, cfg, step, counters,
                                   is_chief)
            elif metrics is not None:
                ray.train.report(metrics)
            window["paused_s"] += time.perf_counter() - pause_start
    finally:
        stream.close()

    return {"steps": step, "images_seen": step * t.global_batch, "final_loss": last_row and last_row["loss"],
            "skipped_steps": counters["skipped_steps"], "world_size": world_size, "resumed_from_step": start_step}


def _window_metrics(window, step, t, lr, ema_decay, world_size, counters, device) -> dict[str, Any]:
    """Average the window's statistics over all workers, reset the window, return one metrics row."""
    elapsed = time.perf_counter() - window["start"] - window["paused_s"]
    totals = torch.stack([window["loss_sum"].float(), torch.tensor(float(window["samples"]), device=device),
                          torch.tensor(window["data_wait_s"] / max(elapsed, 1e-9), device=device)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, samples, wait_frac_sum = totals.tolist()
    row = {
        "step": step,
        "images_seen": step * t.global_batch,
        "loss": loss_sum / max(samples, 1),
        "grad_norm": window["grad_norm_sum"] / window["finite_steps"] if window["finite_steps"] else float("nan"),
        "lr": lr,
        "ema_decay": ema_decay,
        "images_per_s": window["steps"] * t.global_batch / max(elapsed, 1e-9),
        "data_wait_frac": wait_frac_sum / world_size,
        "world_size": world_size,
        "skipped_steps": counters["skipped_steps"],
    }
    window.update(loss_sum=torch.zeros((), device=device), samples=0, grad_norm_sum=0.0, finite_steps=0,
                  data_wait_s=0.0, steps=0, paused_s=0.0, start=time.perf_counter())
    return row


@torch.no_grad()
def _save_sample_grid(ema, diffusion, cfg: Config, step: int, run_dir: Path, device) -> None:
    """A fixed-seed DDIM grid from the EMA weights in fp32."""
    t, d = cfg.train, cfg.data
    images = diffusion.sample(ema, (t.sample_num, d.channels, d.resolution, d.resolution), sampler="ddim",
                              steps=t.sample_steps, generator=torch.Generator().manual_seed(t.seed), device=device)
    save_grid(images, run_dir / "samples" / f"step_{step:08d}.png")


def _report_checkpoint(metrics, model, ema, optimizer, scaler, cfg, step, counters, is_chief) -> None:
    """Report with a checkpoint: the chief writes the full state, every worker takes part in the report."""
    with tempfile.TemporaryDirectory(prefix="raydiff-ckpt-") as directory:
        checkpoint = None
        if is_chief:
            write_state(Path(directory), training_state(model, ema, optimizer, scaler, cfg, step, counters))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(step))
