"""The per-worker DDPM training loop that Ray Train runs on every worker.

Read `train_worker` top to bottom: set up, resume, then one optimizer step per iteration (see
`raydiff.training.step`), the non-finite-streak guard, and the cadences (validate, log, sample, checkpoint).
Progress is counted in optimizer steps and images seen. The loop is restartable at any checkpoint: after a
failure, a resize or a re-run it continues bit for bit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from raydiff.config import Config
from raydiff.data.loader import BatchStream, ImageTable, MicroBatch
from raydiff.data.order import SampleOrder, rank_share
from raydiff.data.stream import StreamTable, open_tables
from raydiff.model.diffusion import build_diffusion
from raydiff.model.ema import EmaUpdater, ema_decay_at, make_ema
from raydiff.model.noise import GRID_NOISE, image_generators
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import checkpoint_name, write_state
from raydiff.runs.dashboards import Dashboards, dashboards_for
from raydiff.runs.images import grid_png
from raydiff.runs.rundir import RunDir
from raydiff.runs.runlog import JsonlLog, progress_line
from raydiff.runs.state import (
    Progress,
    Restored,
    Unresumable,
    apply_config,
    checkpoint_candidates,
    restore_newest,
    training_state,
)
from raydiff.runs.writer import BackgroundWrites
from raydiff.training.distributed import from_rank_zero, interrupt_requested, smallest
from raydiff.training.in_run_quality import InRunQuality, ema_drift, evaluate_in_run
from raydiff.config.lr_rule import describe_lr
from raydiff.training.lr import lr_at
from raydiff.training.microbatch import measure_micro_batch
from raydiff.training.step import (
    StepInputs,
    StepResult,
    compiled,
    make_optimizer,
    optimizer_step,
    resolve_precision,
    speed_options,
)
from raydiff.training.validation import Validation, holdout_split
from raydiff.training.window import MetricsWindow, NonFiniteSteps

logger = logging.getLogger("raydiff")
CHECK_EVERY_STEPS = 10  # how often the workers look at the device's counters and agree on stop / preemption
REMOTE_METRICS_FLUSH_S = 30.0  # an object store cannot append: metrics.jsonl is rewritten at most this often


def quiet_ray_train_logs() -> None:
    """Ray 2.60 names some Train loggers by file path (`getLogger(__file__)`), so they escape RunConfig's
    LoggingConfig and print every report on every worker; raise just those to WARNING."""
    for name in list(logging.root.manager.loggerDict):
        if "ray/train/" in name.replace("\\", "/"):
            logging.getLogger(name).setLevel(logging.WARNING)


@dataclass
class Worker:
    """What one worker holds for the whole run."""

    cfg: Config
    run_dir: RunDir
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module  # the bare model (the EMA follows it; checkpoints hold it)
    ema: torch.nn.Module
    ema_update: EmaUpdater
    speed: dict[str, Any]  # what train.compile and train.channels_last mean here (`speed_options`)
    step_inputs: StepInputs
    table: ImageTable | StreamTable
    order: SampleOrder
    validation: Validation | None
    quality: InRunQuality | None  # eval.every / eval.at_end: the feature network and the reference
    micro_batch: int
    metrics_log: JsonlLog | None  # rank 0 only
    events: JsonlLog | None  # rank 0 only
    writes: BackgroundWrites | None  # rank 0 only: metrics and sample grids go to storage on this thread

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def objects(self) -> tuple:
        s = self.step_inputs
        return self.model, self.ema, s.optimizer, s.scaler

    def open_stream(self, progress: Progress) -> BatchStream:
        t = self.cfg.train
        return BatchStream(table=self.table, order=self.order, global_batch=t.global_batch,
                           share=rank_share(t.global_batch, self.world_size, self.rank), micro_batch=self.micro_batch,
                           start_step=progress.stream_step, pin_memory=self.device.type == "cuda",
                           noise=(t.seed, self.cfg.diffusion.timesteps))

    def event(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.append({"event": event, **fields, "time": time.time()})


def train_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    cfg = Config.from_dict(loop_config["config"])
    t = cfg.train
    torch.set_num_threads(loop_config["torch_threads"])
    quiet_ray_train_logs()
    w = _set_up(cfg, loop_config)

    # Resume from the newest checkpoint that restores: on storage, or the one Ray Train hands us. Until then
    # nothing is written: a start the workers refuse leaves the run directory as it was.
    try:
        progress = _resume(w, ray.train.get_checkpoint())
    except Unresumable as exc:
        return {"status": "unresumable", "diagnostic": str(exc), "steps": 0}
    start_step = progress.step
    stream, window = w.open_stream(progress), MetricsWindow(w.device, progress.window, w.is_chief)
    # TensorBoard / MLflow / W&B from rank 0; points past the checkpoint (lost work) are hidden on TensorBoard.
    dashboards = dashboards_for(cfg, w.run_dir, resume_step=progress.step) if w.is_chief else None
    if w.is_chief:
        for name, text in loop_config.get("records", {}).items():  # the driver's records of this start
            w.run_dir.write_text(name, text)
        w.metrics_log.truncate_after(progress.step)  # rows past the checkpoint belong to lost work
        w.event("start", invocation=loop_config["invocation"], step=progress.step, world_size=w.world_size,
                pid=os.getpid())
        share = rank_share(t.global_batch, w.world_size, 0)
        logger.info(f"[raydiff] {'resuming at step ' + str(progress.step) if progress.step else 'starting'}: "
                    f"{w.world_size} worker(s), global batch {t.global_batch} = {share.size} on worker 0 in "
                    f"micro-batches of up to {w.micro_batch}, device {w.device}; {describe_lr(t)}; compile "
                    f"{w.speed['compile']}, channels_last {w.speed['channels_last']}, gradient compression "
                    f"{w.speed['grad_compression']}")
    order_log = _order_log(w.run_dir, w.rank) if cfg.debug.record_order else None
    fault = _fault_injection(cfg, w.is_chief)
    nonfinite = NonFiniteSteps(w.device, progress.counters["skipped_steps"])
    last_row, last_checkpoint_step, diagnostic, val_loss, stopped = None, progress.step, None, None, False
    quality: dict[str, Any] | None = None  # the newest evaluation's metrics
    preemption_handled = False  # one checkpoint per preemption notice, not one per check while it lasts
    run_start = time.perf_counter()
    try:
        while progress.step < t.total_steps:
            # Fetch this worker's micro-batches of the step.
            wait_start = time.perf_counter()
            batches = next(stream)
            data_wait_s = time.perf_counter() - wait_start
            if cfg.debug.step_delay_s:
                time.sleep(cfg.debug.step_delay_s)
            if order_log is not None:
                _record_order(order_log, progress.step + 1, batches)

            # One optimizer step.
            next_step = progress.step + 1
            lr = lr_at(progress.step, t.lr, t.warmup_steps)
            ema_decay = ema_decay_at(next_step, t.ema_decay, t.ema_warmup_steps)
            result = optimizer_step(w.step_inputs, batches, lr=lr, ema=w.ema_update, ema_decay=ema_decay,
                                    fault=functools.partial(fault, next_step))
            progress.step += 1
            step = progress.step
            window.add(result, data_wait_s)
            nonfinite.add(result.finite)
            done = step == t.total_steps
            check = step % CHECK_EVERY_STEPS == 0 or done  # the device's counters are read only here
            if check or step % t.log_every == 0:
                progress.counters["skipped_steps"] = nonfinite.skipped_steps()

            # Too many non-finite steps in a row: roll back past them once, then give up.
            if check and nonfinite.longest_streak() >= t.max_bad_steps:
                rolled_back = _roll_back(w, progress) if progress.counters["rollbacks"] == 0 else None
                if rolled_back is not None:
                    progress = rolled_back
                    stream.close()
                    stream, window = w.open_stream(progress), MetricsWindow(w.device, progress.window, w.is_chief)
                    nonfinite = NonFiniteSteps(w.device, progress.counters["skipped_steps"])
                    if dashboards is not None:  # reopened: the rolled-back steps' points disappear
                        dashboards.close()
                        dashboards = dashboards_for(cfg, w.run_dir, resume_step=progress.step)
                    continue
                diagnostic = _divergence_report(t, step, lr, result, cfg.diffusion.timesteps)
                w.event("diverged", step=step, diagnostic=diagnostic)
                if w.is_chief:
                    logger.error(f"[raydiff] {diagnostic}")
                break

            # Validate, log, sample and checkpoint at their cadences (the same decision on every worker).
            validated = w.validation is not None and ((t.val_every and step % t.val_every == 0) or done)
            if validated:
                val_start = time.perf_counter()
                val_loss = w.validation.loss(w.ema, w.step_inputs.diffusion, w.device)
                window.paused_s += time.perf_counter() - val_start
            e = cfg.eval
            evaluated = w.quality is not None and ((e.every and step % e.every == 0) or (done and e.at_end))
            if evaluated:
                eval_start = time.perf_counter()
                quality = evaluate_in_run(w.quality, w.ema, w.step_inputs.diffusion, cfg, w.rank, w.world_size,
                                          w.device)
                quality["eval_s"] = round(time.perf_counter() - eval_start, 2)
                window.paused_s += quality["eval_s"]  # like sampling: not training time
            metrics = None
            if step % t.log_every == 0 or done or validated or evaluated:
                metrics = window.close(step=step, global_batch=t.global_batch, lr=lr, ema_decay=ema_decay,
                                       world_size=w.world_size, skipped_steps=progress.counters["skipped_steps"])
                metrics["time_s"] = round(time.perf_counter() - run_start, 3)
                if w.device.type == "cuda":
                    metrics["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(w.device) / 1e9, 3)
                metrics["ema_drift"] = ema_drift(w.ema, w.model)
                if validated:
                    metrics["val_loss"] = val_loss
                if evaluated:
                    metrics.update(quality)
                last_row = metrics
                if w.is_chief:
                    w.metrics_log.append(metrics)
                    if dashboards is not None:
                        dashboards.metrics(metrics)
                    logger.info(progress_line(metrics, t.total_steps, start_step, time.perf_counter() - run_start))
            pause_start = time.perf_counter()  # sampling and checkpointing do not count as training time
            if w.is_chief and ((t.sample_every and step % t.sample_every == 0) or done):
                _save_sample_grid(w, step, dashboards)
            interrupt = None
            if check and not done:
                simulated = 0 < cfg.debug.preemption_from_step <= step
                interrupt = interrupt_requested(loop_config.get("stop_flag"), w.is_chief, w.device, simulated)
                notice = interrupt == "preemption"
                if notice and preemption_handled:
                    interrupt = None  # this notice has its checkpoint already
                preemption_handled = notice
            # Ray sees checkpoints, validation losses and quality metrics (Tune stops trials on them). Other rows go to
            # metrics.jsonl only: each report waits for Ray Train's controller to poll it (every 2 s).
            report = {"step": step, "images_seen": step * t.global_batch, **(quality or {}), **(metrics or {}),
                      **({"val_loss": val_loss} if val_loss is not None else {})}
            if step % t.checkpoint_every == 0 or done or (interrupt and last_checkpoint_step != step):
                if interrupt:
                    w.event(f"{interrupt}_checkpoint", step=step)
                _report_checkpoint(w, report, progress, window)
                last_checkpoint_step = step
                if dashboards is not None:
                    dashboards.flush()
            elif validated or evaluated:
                ray.train.report(report, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            window.paused_s += time.perf_counter() - pause_start
            if interrupt == "stop":
                stopped = True
                break
    finally:
        if w.is_chief:
            w.metrics_log.flush()
            w.writes.close()
        if dashboards is not None:
            dashboards.close()
        stream.close()
        if order_log is not None:
            order_log.close()

    status = "diverged" if diagnostic else "stopped" if stopped else "finished"
    return {"status": status, "diagnostic": diagnostic, "steps": progress.step,
            "images_seen": progress.step * t.global_batch, "final_loss": last_row and last_row["loss"],
            "skipped_steps": progress.counters["skipped_steps"], "rollbacks": progress.counters["rollbacks"],
            "world_size": w.world_size, "resumed_from_step": start_step, "val_loss": val_loss,
            "quality": quality}


def _set_up(cfg: Config, loop_config: dict[str, Any]) -> Worker:
    """Build the model, its EMA, the optimizer, the loss scaler, the data and the logs of this worker."""
    t = cfg.train
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    speed = speed_options(t.compile, t.channels_last, device)
    torch.backends.cudnn.benchmark = device.type == "cuda"  # fixed shapes: autotune the convolutions once
    torch.manual_seed(t.seed)  # identical initial weights on every worker
    model = build_model(cfg).to(device)
    if loop_config.get("init_weights") is not None:  # model.init_from: the driver sends it to new runs only
        model.load_state_dict(ray.get(loop_config["init_weights"]))
    if speed["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    ema = make_ema(model)
    optimizer = make_optimizer(model, lr=t.lr, weight_decay=t.weight_decay)
    autocast_dtype = resolve_precision(t.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    diffusion = build_diffusion(cfg)
    run_dir: RunDir = loop_config["run_dir"]

    # Split off the held-out images; the rest is the training stream (from memory, or streamed shard by shard).
    images = loop_config["images"]
    train_indices, val_indices = holdout_split(images.usable_indices(), cfg.data.val_images, t.seed)
    table, order, val_table, val_indices = open_tables(images, train_indices, val_indices, t.seed,
                                                      group=from_rank_zero(uuid.uuid4().hex))
    validation = Validation(table=val_table, val_indices=val_indices, seed=t.seed, timesteps=diffusion.timesteps,
                            rank=rank, world_size=world_size) if len(val_indices) else None
    if t.micro_batch == "auto":
        share = rank_share(t.global_batch, world_size, rank)
        micro_batch = smallest(measure_micro_batch(model, diffusion, optimizer, share=share.size, shape=images.shape,
                                                   device=device, autocast_dtype=autocast_dtype), device)
    else:
        micro_batch = cfg.micro_batch_for(world_size)

    is_chief = rank == 0
    writes = BackgroundWrites() if is_chief else None
    step_inputs = StepInputs(model=model, optimizer=optimizer, scaler=scaler, diffusion=diffusion, device=device,
                             autocast_dtype=autocast_dtype, seed=t.seed, flip=cfg.data.flip,
                             global_batch=t.global_batch, world_size=world_size, grad_clip=t.grad_clip,
                             dropout=cfg.model.dropout > 0, channels_last=speed["channels_last"])
    return Worker(
        cfg=cfg, run_dir=run_dir, rank=rank, world_size=world_size, device=device, model=model, ema=ema,
        ema_update=EmaUpdater(ema, model), speed=speed,
        step_inputs=step_inputs, table=table, order=order, validation=validation,
        quality=ray.get(loop_config["quality"]) if loop_config.get("quality") is not None else None,
        micro_batch=micro_batch,
        metrics_log=JsonlLog(run_dir, "metrics.jsonl", flush_every_s=REMOTE_METRICS_FLUSH_S,
                             writes=writes) if is_chief else None,
        events=JsonlLog(run_dir, "events.jsonl") if is_chief else None, writes=writes,
    )


def _restore_agreed(w: Worker, latest: ray.train.Checkpoint | None = None) -> Restored | None:
    """Restore the newest checkpoint that loads on every worker alike. Rank 0 chooses: it lists storage and tries
    the candidates; every other worker then restores exactly the one rank 0 restored (a newer one that another
    worker could read, say one still being written, would leave replicas that differ). None when there are no
    checkpoints; raises `Unresumable` on every worker when there are and none restores."""
    restored, refusal = None, None
    if w.is_chief:
        try:
            restored = restore_newest(checkpoint_candidates(w.run_dir, latest), *w.objects)
        except Unresumable as exc:
            refusal = str(exc)
    refusal, found = from_rank_zero((refusal, restored and restored.checkpoint))
    if refusal:
        raise Unresumable(refusal)
    if found is not None and not w.is_chief:
        try:
            restored = restore_newest([found], *w.objects)
        except Unresumable as exc:  # rank 0 could restore it: a failure here is this worker's (Ray restarts)
            raise RuntimeError(str(exc)) from exc
    return restored


def _resume(w: Worker, latest: ray.train.Checkpoint | None) -> Progress:
    """Restore the newest checkpoint that loads (`_restore_agreed`), then wrap the model for DDP."""
    restored = _restore_agreed(w, latest)
    if restored is not None and w.is_chief:
        for note in restored.notes:
            logger.warning(f"[raydiff] note: {note}")
    apply_config(w.step_inputs.optimizer, weight_decay=w.cfg.train.weight_decay)
    # DDP's gradient buckets double as the .grad tensors: no copy between them after each all-reduce.
    model = ray.train.torch.prepare_model(w.model, parallel_strategy_kwargs={"gradient_as_bucket_view": True})
    w.speed["grad_compression"] = "none"
    if w.cfg.train.grad_compression == "bf16" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(state=None, hook=bf16_compress_hook)  # averages in bf16, as the default does in fp32
        w.speed["grad_compression"] = "bf16"
    w.step_inputs.model = compiled(model, w.speed["compile"], fallback=w.speed["compile_fallback"])
    return restored.progress if restored is not None else Progress()


def _roll_back(w: Worker, progress: Progress) -> Progress | None:
    """Back to the newest checkpoint, then on past the stream positions of the failed steps (as PaLM does): a
    replay of the same data from the same weights would fail again. None when no checkpoint restores."""
    try:
        restored = _restore_agreed(w)
    except Unresumable:
        return None
    if restored is None:
        return None
    back = restored.progress
    failed_from = back.stream_step  # the stream positions of steps back.step+1 .. progress.step failed
    back.counters["rollbacks"] = progress.counters["rollbacks"] + 1
    back.counters["stream_offset"] += progress.step - back.step
    back.counters["skipped_steps"] = progress.counters["skipped_steps"]
    gb = w.cfg.train.global_batch
    if w.is_chief:
        w.metrics_log.truncate_after(back.step)
        w.event("rollback", from_step=progress.step, to_step=back.step, checkpoint=str(restored.checkpoint),
                skipped_positions=[failed_from * gb, back.stream_step * gb])
        logger.warning(f"[raydiff] WARNING: {w.cfg.train.max_bad_steps} non-finite steps in a row at step "
                       f"{progress.step}: rolled back to step {back.step} and skipped the {progress.step - back.step} "
                       f"steps of data that failed")
    return back


def _fault_injection(cfg: Config, is_chief: bool):
    """debug.nan_at_steps: a transient fault, once per step number, on rank 0. debug.nan_at_samples: a persistent
    one, every time one of these samples is trained (a poisoned image)."""
    once: set[int] = set()
    poisoned = frozenset(cfg.debug.nan_at_samples)

    def fault(step: int, batch: MicroBatch) -> bool:
        if is_chief and step in cfg.debug.nan_at_steps and step not in once:
            once.add(step)
            return True
        return bool(poisoned) and not poisoned.isdisjoint(batch.indices.tolist())
    return fault


def _order_log(run_dir: RunDir, rank: int):
    """Audit trail of the samples this worker trains on (debug.record_order; a local run.storage only)."""
    folder = run_dir.local / "order"
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"rank{rank}_pid{os.getpid()}.jsonl", "a", buffering=1)


def _record_order(log, step: int, batches: list[MicroBatch]) -> None:
    log.write(json.dumps({"step": step, "positions": [batches[0].position, batches[-1].position + len(batches[-1])],
                          "indices": [int(i) for b in batches for i in b.indices]}) + "\n")


def _divergence_report(t, step: int, lr: float, result: StepResult, num_timesteps: int) -> str:
    """One line that says what was going on when training diverged, so the user can act on it."""
    buckets = []
    for q in range(4):
        low, high = q * num_timesteps // 4, (q + 1) * num_timesteps // 4
        selected = result.losses.detach().float()[(result.timesteps >= low) & (result.timesteps < high)]
        mean = f"{selected.mean().item():.4g}" if len(selected) else "-"
        buckets.append(f"t {low}-{high - 1}: {mean}")
    x0 = result.x0
    return (f"training diverged: {t.max_bad_steps} non-finite steps in a row at step {step} (rolled back at most "
            f"once before); lr {lr:.3g}, grad norm {float(result.grad_norm):.3g}, input range "
            f"[{x0.min().item():.3g}, {x0.max().item():.3g}], loss by timestep ({'; '.join(buckets)}). Try a lower "
            f"train.lr, more train.warmup_steps, train.grad_clip, or train.precision=fp32/bf16.")


@torch.no_grad()
def _save_sample_grid(w: Worker, step: int, dashboards: Dashboards | None) -> None:
    """A fixed-seed DDIM grid from the EMA weights in fp32, in samples/ and on the dashboards."""
    t, d = w.cfg.train, w.cfg.data
    images = w.step_inputs.diffusion.sample(
        w.ema, (t.sample_num, d.channels, d.resolution, d.resolution), sampler="ddim", steps=t.sample_steps,
        generator=image_generators(t.seed, range(t.sample_num), w.device, GRID_NOISE), device=w.device)
    png = grid_png(images)
    w.writes.submit(w.run_dir.write_bytes, f"samples/step_{step:08d}.png", png)
    if dashboards is not None:
        dashboards.image("samples", png, step)


def _report_checkpoint(w: Worker, metrics: dict[str, Any], progress: Progress, window: MetricsWindow) -> None:
    """Report with a checkpoint: the chief writes the full state, every worker takes part in the report.
    Ray uploads it in the background and deletes the local copy, so training goes on at once."""
    progress.window = window.checkpoint_state()  # a collective: the window's sums over all workers
    checkpoint = None
    if w.is_chief:
        w.metrics_log.flush()  # the rows up to this checkpoint are kept on resume: on storage before it
        w.writes.drain()
        directory = Path(tempfile.mkdtemp(prefix="raydiff-ckpt-"))
        write_state(directory, training_state(*w.objects, progress, w.cfg.train.global_batch, w.cfg.to_dict()))
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(progress.step, w.run_dir),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
