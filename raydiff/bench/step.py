"""`python -m raydiff.bench step`: raydiff's optimizer step in this process, against the bare step, its parts
added one at a time.

Why: `bench throughput` compares whole runs (Ray, the loader, the loop's cadence) with the bare loop. When raydiff
is slower, this says which part of the step costs the difference, in a minute and without Ray. All rows share one
compiled loss (one compilation), with raydiff's speed plan for the device, and run in this order:
- `bare`: the bare loop's step (`bench throughput`'s), on images and noise already on the device;
- `step`: raydiff's `optimizer_step` on one batch, drawn from its loader once and reused: the loader idle;
- `loader`: the step on a new batch every step from the loader thread, as the training loop gets them;
- `ema`: that and the EMA update: what a worker runs with `data.on_device: false`, less Ray and the loop's cadence;
- `on_device`: the step and the EMA on a new batch every step gathered on the device from the images kept there
  (`data.on_device`, `raydiff.data.on_device`), no loader thread: what a GPU worker runs where the data fits.

Each row: the median img/s of MEASURED_CHUNKS chunks, the slowest and the fastest chunk (a wide spread: the step
shares the host with something), and the host's milliseconds per step (`host_ms`: the time to issue HOST_STEPS
steps once the device is idle, the least of three tries; on a GPU a step whose host time exceeds the device's
waits for the host); for `loader` and `ema`, the loader thread's CPU milliseconds per step it made
(`loader_cpu_ms`: the host time it takes beside the training thread). The module also holds what `bench
throughput` shares with it: timing in chunks, the model and step under the speed plan, and the profile of the
step (`profile_step`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from raydiff.cluster.devices import device_name, synchronize
from raydiff.config import Config
from raydiff.storage.atomic import new_file

if TYPE_CHECKING:
    from raydiff.data.loader import ImageTable
    from raydiff.data.on_device import DeviceImages
    from raydiff.training.speed import SpeedPlan
    from raydiff.training.step import StepParts

MEASURED_CHUNKS = 5
HOST_STEPS = 3
def chunks(steps: int) -> list[int]:
    """`steps` split into up to MEASURED_CHUNKS near-equal chunks."""
    n = min(MEASURED_CHUNKS, steps)
    return [steps // n + (i < steps % n) for i in range(n)]


def measure(step: Callable[[], object], device: torch.device, *, steps: int, batch: int) -> dict[str, Any]:
    """Time one loop: its first step (compilation included), `steps` - 1 more warm-up steps, then the median img/s
    of MEASURED_CHUNKS chunks of `steps` steps (and each chunk's), the peak memory of the measured steps, and the
    graphs compiled and found in the compile cache on the way."""
    from raydiff.training.compile_cache import graph_counts

    compiled, cached = graph_counts()
    start = time.perf_counter()
    step()
    synchronize(device)
    first_step_s = time.perf_counter() - start
    for _ in range(steps - 1):
        step()
    synchronize(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for chunk in chunks(steps):
        chunk_start = time.perf_counter()
        for _ in range(chunk):
            step()
        synchronize(device)
        rates.append(chunk * batch / (time.perf_counter() - chunk_start))
    peak = round(torch.cuda.max_memory_allocated(device) / 1e9, 3) if device.type == "cuda" else None
    compiled_after, cached_after = graph_counts()
    return {"img_s": round(statistics.median(rates), 1), "chunks_img_s": [round(r, 1) for r in rates],
            "first_step_s": round(first_step_s, 2), "warmup_s": round(warmup_s, 2), "peak_memory_gb": peak,
            "graphs_compiled": compiled_after - compiled, "graphs_cached": cached_after - cached}


def host_ms(step: Callable[[], object], device: torch.device) -> float:
    """The host's milliseconds per step: HOST_STEPS steps issued on an idle device, the least of three tries."""
    tries = []
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(HOST_STEPS):
            step()
        tries.append((time.perf_counter() - start) / HOST_STEPS * 1e3)
    synchronize(device)
    return round(min(tries), 3)


def take_gpu_worker_threads(cfg: Config, device: torch.device) -> None:
    """On a GPU, this bench process runs with the intra-op threads of a GPU worker (`scaling.cpus_per_worker`, 1 by
    default there: `raydiff.cluster.devices.worker_cpus`), for all of its loops alike: the setting raydiff's step
    runs with, and the same key in torch's compile cache (which counts the threads where a graph has CPU code), so
    that the bench's loops can find the graphs raydiff's worker compiled. On a CPU the threads stay as they are."""
    from raydiff.cluster.devices import torch_threads, worker_cpus

    if device.type == "cuda":
        torch.set_num_threads(torch_threads(worker_cpus(cfg.scaling, use_gpu=True, cpus=os.cpu_count() or 1)))


def planned_model(cfg: Config, device: torch.device):
    """(speed plan, model, autocast dtype) as one worker of raydiff sets them up on `device`, with its backend
    settings (TF32 as planned, cuDNN's autotuning: the caller puts back what was set before, `backend_flags`)."""
    from raydiff.model.unet import build_model
    from raydiff.training.speed import apply_training_flags, plan_speed
    from raydiff.training.step import resolve_precision

    # No eager fallback (`train.compile: auto`'s): a compilation that fails is an error here, not eager steps
    # measured under a "compile on" label.
    plan = dataclasses.replace(plan_speed(cfg.train, device, world_size=1), compile_fallback=False)
    apply_training_flags(plan, device)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    if plan.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return plan, model, resolve_precision(cfg.train.precision, device)


def planned_step(cfg: Config, device: torch.device):
    """(speed plan, the step's parts, model) as one worker of raydiff trains on `device`: its loss under the
    speed plan (one worker: no DDP), fused AdamW, the loss scaler; one micro-batch per step."""
    from raydiff.model.diffusion import build_diffusion
    from raydiff.training.speed import for_training
    from raydiff.training.step import StepParts, make_optimizer

    t = cfg.train
    plan, model, dtype = planned_model(cfg, device)
    parts = StepParts.build(model, build_diffusion(cfg), make_optimizer(model, lr=1e-4, weight_decay=t.weight_decay),
                            torch.amp.GradScaler(device.type, enabled=dtype == torch.float16), device=device,
                            autocast_dtype=dtype, seed=0, flip=cfg.data.flip, global_batch=t.global_batch,
                            world_size=1, grad_clip=t.grad_clip, dropout=cfg.model.dropout > 0,
                            channels_last=plan.channels_last)
    parts.loss, parts.cuda_graphs = for_training(parts.loss, plan, device, world_size=1), plan.cuda_graphs
    return plan, parts, model


def bare_step(cfg: Config, plan: SpeedPlan, parts: StepParts, model: torch.nn.Module) -> Callable[[], None]:
    """The bare loop's step on `planned_step`'s parts: its loss, fused AdamW, clipping, on uint8 images, flips,
    timesteps and noise drawn on the device; no loader, no EMA, no bookkeeping."""
    t, d = cfg.train, cfg.data
    device, batch = parts.device, t.global_batch
    params = list(model.parameters())
    shape = (batch, d.channels, d.resolution, d.resolution)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    flips = torch.rand(batch, device=device) < 0.5

    def step() -> None:
        timesteps = torch.randint(0, parts.timesteps, (batch,), device=device)
        if plan.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        losses = parts.loss(images, flips, timesteps, torch.randn(shape, device=device))
        parts.scaler.scale(losses.mean()).backward()
        parts.scaler.unscale_(parts.optimizer)
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else math.inf)
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
        parts.optimizer.zero_grad(set_to_none=True)

    return step


def bench_table(cfg: Config) -> ImageTable:
    """Random uint8 images of the config's shape, four global batches of them, as a worker's in-memory table."""
    import numpy as np

    from raydiff.data.loader import ImageTable

    t, d = cfg.train, cfg.data
    return ImageTable([np.random.default_rng(0).integers(
        0, 256, (4 * t.global_batch, d.channels, d.resolution, d.resolution), dtype=np.uint8)])


def bench_stream(cfg: Config, device: torch.device, table: ImageTable, images: DeviceImages | None = None):
    """One worker's batches of `table` (`bench_table`'s images), as a worker on `device` opens them: by the loader
    thread, or gathered on the device from `images` (the same images kept there: `data.on_device`)."""
    from raydiff.data.on_device import open_batches
    from raydiff.data.order import SampleOrder, rank_share

    t = cfg.train
    return open_batches(table=table, images=images, order=SampleOrder(len(table), seed=0),
                        global_batch=t.global_batch, share=rank_share(t.global_batch, 1, 0),
                        micro_batch=t.global_batch, start_step=0, seed=0, timesteps=cfg.diffusion.timesteps,
                        device=device)


def worker_stream(cfg: Config, device: torch.device):
    """The batches as a worker on `device` gets them: gathered on the device or by the loader thread, as
    `data.on_device` decides there."""
    from raydiff.data.on_device import place_images

    table = bench_table(cfg)
    images, _ = place_images(cfg.data.on_device, table, device)
    return bench_stream(cfg, device, table, images)


def bench_step(config: str, overrides: list[str], *, steps: int, batch: int | None) -> dict[str, Any]:
    """The rows of the module's docstring for a preset, at `batch` images per step (default: its global batch), on
    the device a worker would train on."""
    from raydiff.bench import load_model_config
    from raydiff.cluster.devices import resolve_device
    from raydiff.config import set_key

    cfg = load_model_config(config, overrides, "step")
    if batch is not None:
        set_key(cfg, "train.global_batch", batch)
    device = resolve_device("auto")
    take_gpu_worker_threads(cfg, device)
    return {"bench": "step", "config": config, **step_rows(cfg, device, steps=steps)}


def step_rows(cfg: Config, device: torch.device, *, steps: int) -> dict[str, Any]:
    """The rows of the module's docstring, at the config's global batch on `device`."""
    from raydiff.data.on_device import DeviceImages
    from raydiff.model.weight_averages import EmaUpdater, PowerEma, make_ema
    from raydiff.training.speed import backend_flags, restore_backend_flags
    from raydiff.training.step import optimizer_step

    batch = cfg.train.global_batch
    saved = backend_flags()
    plan, parts, model = planned_step(cfg, device)
    update = EmaUpdater(make_ema(model), model)
    # train.ema: posthoc adds the power-function averages to the classic one, as the run's step does.
    posthoc = PowerEma(model, cfg.train.ema_sigma_rels, staged_by=update) if cfg.train.ema == "posthoc" else None
    counted = itertools.count(1)  # the post-hoc averages' time: the step's number

    def averaged(batches) -> object:
        return optimizer_step(parts, batches, lr=1e-4, ema=update, ema_decay=0.999, posthoc=posthoc,
                              step=next(counted))

    table = bench_table(cfg)
    stream, gathered = bench_stream(cfg, device, table), bench_stream(cfg, device, table, DeviceImages(table, device))
    reused = next(stream)
    steps_of: dict[str, Callable[[], object]] = {
        "bare": bare_step(cfg, plan, parts, model),
        "step": lambda: optimizer_step(parts, reused, lr=1e-4),
        "loader": lambda: optimizer_step(parts, next(stream), lr=1e-4),
        "ema": lambda: averaged(next(stream)),
        "on_device": lambda: averaged(next(gathered)),
    }
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name, step in steps_of.items():
            produced, cpu_s = stream.produced_steps, stream.cpu_s
            measured = measure(step, device, steps=steps, batch=batch)
            rows[name] = {"img_s": measured["img_s"], "chunks_img_s": measured["chunks_img_s"],
                          "host_ms": host_ms(step, device)}
            if name in ("loader", "ema"):  # the loader thread's CPU time per step it made for this row
                made = stream.produced_steps - produced
                rows[name]["loader_cpu_ms"] = round((stream.cpu_s - cpu_s) / max(made, 1) * 1e3, 3)
            if name == "bare":  # the first row compiles the loss that every row runs
                first_step = {k: measured[k] for k in ("first_step_s", "graphs_compiled", "graphs_cached")}
    finally:
        stream.close()
        restore_backend_flags(saved)
    return {"device": device_name(device), "torch": torch.__version__, "global_batch": batch, "steps": steps,
            "described": plan.describe(), "ema": cfg.train.ema, **first_step, "rows": rows,
            "ratio_bare": {name: round(row["img_s"] / rows["bare"]["img_s"], 3)
                           for name, row in rows.items() if name != "bare"}}


def profile_step(cfg: Config, device: torch.device, *, steps: int, out: Path) -> dict[str, float | None]:
    """The top kernels of raydiff's steady-state step (its own `optimizer_step`, batches as `data.on_device` gets
    them, its speed plan; in this process, no Ray), by device time on a GPU and by CPU time on a CPU, as a table in
    `out`; returns the device's busy time and the host's launches per step (None and 0 on a CPU)."""
    from torch.profiler import profile

    from raydiff.model.weight_averages import EmaUpdater, make_ema
    from raydiff.training.profiling import activities, summarize
    from raydiff.training.speed import backend_flags, restore_backend_flags
    from raydiff.training.step import optimizer_step

    saved = backend_flags()
    plan, parts, model = planned_step(cfg, device)
    stream = worker_stream(cfg, device)
    update = EmaUpdater(make_ema(model), model)
    try:
        for _ in range(steps):
            optimizer_step(parts, next(stream), lr=1e-4, ema=update, ema_decay=0.999)
        synchronize(device)
        with profile(activities=activities(device)) as profiler:
            for _ in range(steps):
                optimizer_step(parts, next(stream), lr=1e-4, ema=update, ema_decay=0.999)
            synchronize(device)
    finally:
        stream.close()
        restore_backend_flags(saved)
    summary = summarize(profiler, steps, device)
    busy = ("" if summary.device_ms is None else
            f"; per step: {summary.device_ms:.2f} ms of device time, {summary.launches:.0f} launches")
    with new_file(out) as tmp:
        tmp.write_text(f"# raydiff's step, {cfg.train.global_batch} images per step, {steps} steps profiled on "
                       f"{device_name(device)}; {plan.describe()}{busy}\n{summary.table}\n")
    return {"device_ms_per_step": None if summary.device_ms is None else round(summary.device_ms, 3),
            "launches_per_step": round(summary.launches, 1)}
