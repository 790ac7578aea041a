"""`python -m raydiff.bench throughput`: where a training step's time goes, raydiff against two baselines.

For each per-device batch (`--batch N[,N...]`, default the config's global batch), on one device, in one run:
- `plain`: the textbook eager loop a user writes by hand: eager model, AdamW (torch's default implementation),
  autocast, GradScaler for fp16, gradient clipping, fresh timesteps and noise each step; no compile. It runs once
  before raydiff's run and once after it (`plain.runs` shows how much the machine drifted).
- `bare`: the fastest loop we know for the model, with nothing else: raydiff's own speed plan for the device
  (compile, channels_last, CUDA graphs, TF32: `raydiff.training.speed`) applied to the same loss module, fused
  AdamW and clipping, over images and noise already on the device. No Ray, no loader, no EMA, no metrics: what
  raydiff's step costs beyond the model itself is `raydiff / bare`. It runs in the bench's own process, whose
  allocator keeps its defaults (`train.keep_host_memory` is set when a worker's process starts), as the plain
  loop's does.
- `raydiff`: the real thing, `python -m raydiff.train` through Ray Train with one worker and its defaults for the
  device, on images decoded by its own ingest; `--rerun` continues the run once more, as a restart would (its
  warm-up shows what the compile cache saves).

Each side's img/s is the median over `raydiff.bench.step.MEASURED_CHUNKS` chunks of its measured steps, so that a
moment when the machine was busy elsewhere does not decide the ratios. Warm-up is split in two: launch to the end
of the first step (Ray, data, set-up and compilation), and first step to steady state.

FLOPs per trained image are counted with torch's FlopCounterMode (forward + backward of the model), so `tflops` =
FLOPs x img/s, and `mfu` = tflops / the device's peak dense bf16 throughput. `--profile FILE` writes the top
kernels of raydiff's steady-state step (CUDA kernels on a GPU, operators on a CPU), profiled in this process, and
on a GPU how busy the device is during raydiff's step (`device_busy`: well below 1, the host is the bottleneck);
and `FILE-worker` (same suffix) the profile of raydiff's run itself, taken inside its worker over ten steps after
the measured ones (`log.profile_steps`; a profiler may slow the host's launches even after it stops, so it comes
last), whose figures are `raydiff.worker_profile` (its `device_busy` measured in the run, the loop's checks, rows
and Ray's calls included).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raydiff.bench import load_model_config
from raydiff.bench.step import (
    bare_step,
    chunks,
    measure,
    planned_step,
    profile_step,
    take_gpu_worker_threads,
)
from raydiff.cluster.devices import device_name
from raydiff.config import Config, set_key

# Peak dense bf16 (and fp16) tensor throughput (TFLOP/s) by device name, the first name it contains (variants
# before their family: "H200 NVL" before "H200", "L40S" and "L40" before "L4"); --peak-tflops for others.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200 NVL", 835.0), ("H200", 989.0),
                    ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
                    ("A10G", 70.0), ("RTX 4090", 165.0))


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def flops_per_image(cfg: Config, device: torch.device) -> float:
    """FLOPs of one training image: the model's forward and backward pass."""
    from torch.utils.flop_counter import FlopCounterMode

    from raydiff.model.unet import build_model

    d, batch = cfg.data, 2
    model = build_model(cfg).to(device)
    x = torch.randn(batch, d.channels, d.resolution, d.resolution, device=device)
    t = torch.randint(0, cfg.diffusion.timesteps, (batch,), device=device)
    with FlopCounterMode(display=False) as counter:
        model(x, t).square().mean().backward()
    return counter.get_total_flops() / batch


def plain_loop(cfg: Config, device: torch.device, *, steps: int) -> dict[str, Any]:
    """The textbook loop (see the module's docstring)."""
    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model
    from raydiff.training.step import resolve_precision

    t, d = cfg.train, cfg.data
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    diffusion = build_diffusion(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=t.weight_decay)
    dtype = resolve_precision(t.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    x0 = torch.rand(t.global_batch, d.channels, d.resolution, d.resolution, device=device) * 2 - 1

    def step() -> None:
        timesteps = torch.randint(0, diffusion.timesteps, (t.global_batch,), device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = diffusion.loss_per_sample(model, x0, timesteps, torch.randn_like(x0)).mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        scaler.step(optimizer)
        scaler.update()

    return measure(step, device, steps=steps, batch=t.global_batch)


def bare_loop(cfg: Config, device: torch.device, *, steps: int) -> dict[str, Any]:
    """The best bare loop (see the module's docstring): raydiff's speed plan, nothing else around the step."""
    from raydiff.training.speed import backend_flags, restore_backend_flags

    saved = backend_flags()
    try:
        plan, parts, model = planned_step(cfg, device)
        return measure(bare_step(cfg, plan, parts, model), device, steps=steps, batch=cfg.train.global_batch)
    finally:
        restore_backend_flags(saved)  # as they were for what runs next in this process (the plain loop)


def rows_every(steps: int) -> int:
    """raydiff's `train.log_every` in the bench: about MEASURED_CHUNKS rows over `steps` measured steps (the median
    row is its img/s), each at one of the loop's checks where `steps` allows. A row, like a check, waits for the
    device to finish the steps queued on it, and the device idles while the host writes the row: rows that fall on
    the checks add no wait a user's run does not have (its rows come every 100 steps in the presets)."""
    from raydiff.training.cadence import CHECK_EVERY_STEPS

    chunk = chunks(steps)[-1]
    every = CHECK_EVERY_STEPS * max(1, chunk // CHECK_EVERY_STEPS)
    return every if steps % every == 0 else chunk


PROFILED_STEPS = 10  # the worker's profile with --profile: this many steps after the measured ones


def raydiff_run(cfg: Config, *, steps: int, storage: Path, rerun: bool,
                profile: Path | None = None) -> dict[str, Any]:
    """raydiff's own training, one worker, `steps` warm-up steps then `steps` measured ones; with `rerun`, the
    run continued for as many again (a restart of the same run). With `profile`, the worker profiles
    PROFILED_STEPS more steps after the measured ones (`log.profile_steps`: neither the warm-up nor the measured
    steps run beside the profiler, whose traces cost the host, nor after it), and their table is copied to
    `profile`; the run ends one step after them, so that its final checkpoint and row are not in the profile."""
    from raydiff.config.checks import validate

    profiled_steps = [2 * steps + 1, 2 * steps + PROFILED_STEPS] if profile is not None else []
    end = 2 * steps + (PROFILED_STEPS + 1 if profiled_steps else 0)
    for key, value in (("scaling.num_workers", 1), ("train.total_steps", end),
                       ("train.log_every", rows_every(steps)),
                       ("train.checkpoint_every", end), ("train.sample_every", 0), ("train.sample_num", 1),
                       ("train.sample_steps", 1), ("data.val_images", 0), ("run.storage", str(storage)),
                       ("run.name", f"throughput-{cfg.train.global_batch}"), ("train.micro_batch", None),
                       ("eval.every", 0), ("eval.at_end", False), ("log.profile_steps", profiled_steps)):
        set_key(cfg, key, value)
    validate(cfg)
    result = _one_start(cfg, steps, storage, first_step=1)
    profile_event = result.pop("profile_event")
    if profiled_steps:
        assert profile is not None  # profiled_steps is empty without it
        result["worker_profile"] = _worker_profile(storage / cfg.run.name, profile_event, profiled_steps, profile)
    if rerun:
        set_key(cfg, "train.total_steps", end + 2 * steps)
        again = _one_start(cfg, steps, storage, first_step=end + 1)
        result["rerun"] = {k: again[k] for k in ("img_s", "start_s", "first_step_s", "warmup_s", "compile_cache")}
    return result


def _worker_profile(run_dir: Path, event: dict[str, Any] | None, steps: list[int],
                    out: Path) -> dict[str, Any] | None:
    """The figures of the run's own profile (`event`, its events.jsonl row, or None), its table copied to `out`;
    None, said on stderr, where the worker could not make one (the run itself, and the bench's figures, stand
    without it). A profile ended early (a stop) is named by the steps it recorded."""
    if event is None:
        print(f"bench throughput: the run's profile of steps {steps[0]}-{steps[1]} was not made (its log says why)",
              file=sys.stderr)
        return None
    first, last = event["steps"]
    table = run_dir / "profile" / f"steps_{first}-{last}.txt"
    if table.is_file():
        out.write_text(table.read_text())
    else:
        print(f"bench throughput: the run's profile of steps {first}-{last} has figures but no table (its log "
              f"says why)", file=sys.stderr)
    return {k: event[k] for k in ("steps", "wall_ms_per_step", "device_ms_per_step", "device_busy",
                                  "launches_per_step")}


def _one_start(cfg: Config, steps: int, storage: Path, *, first_step: int) -> dict[str, Any]:
    """One start of the bench's run, from `first_step` to train.total_steps: its numbers from metrics.jsonl and
    events.jsonl (the start event, the first step's seconds, the newest profile's row or None); measured over its
    steps `steps` after `first_step` (steps after those, profiled, are not measured)."""
    from raydiff.training.driver import run_training

    launched = time.time()
    summary = run_training(cfg)
    if summary["status"] != "finished":
        raise RuntimeError(f"the raydiff run ended {summary['status']}: {summary.get('error')}")
    run_dir = storage / cfg.run.name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = [e for e in events if e["event"] == "start"][-1]
    first = [e for e in events if e["event"] == "first_step"][-1]
    profiles = [e for e in events if e["event"] == "profile"]
    mine = [row for row in rows if first_step <= row["step"] < first_step + 2 * steps]
    warm = [row for row in mine if row["step"] < first_step + steps][-1]
    measured = [row for row in mine if row["step"] >= first_step + steps]
    peaks = [row["peak_memory_gb"] for row in measured if row.get("peak_memory_gb") is not None]
    return {"img_s": round(statistics.median(row["images_per_s"] for row in measured), 1),
            "start_s": round(start["time"] - launched, 2), "first_step_s": round(first["seconds"], 2),
            "warmup_s": round(warm["time_s"], 2), "peak_memory_gb": max(peaks) if peaks else None,
            "data_wait_frac": round(statistics.median(row["data_wait_frac"] for row in measured), 4),
            "compile_cache": start.get("compile_cache"), "described": start["speed"], "data": start.get("data"),
            "profile_event": profiles[-1] if profiles else None}


PARTIAL = "bench throughput: raydiff measured"  # the line a cut bench leaves with raydiff's own figures


def bench_throughput(config: str, overrides: list[str], *, steps: int, batches: list[int] | None,
                     peak: float | None, profile: Path | None = None, rerun: bool = False) -> Iterator[dict[str, Any]]:
    """One result per per-device batch (see the module's docstring), each as soon as it is measured."""
    from raydiff.cluster.devices import resolve_device
    from raydiff.cluster.start import init_ray
    from raydiff.training.step import resolve_precision

    base = load_model_config(config, overrides, "throughput")
    device = resolve_device("auto")
    take_gpu_worker_threads(base, device)
    # The table's peaks are bf16's and fp16's: an fp32 (TF32) run's MFU needs its own --peak-tflops.
    half = resolve_precision(base.train.precision, device) is not None
    peak = peak or (peak_tflops(device_name(device)) if half else None)
    init_ray()  # the baselines run beside the same idle Ray processes as raydiff's worker: same conditions
    batches = batches or [base.train.global_batch]
    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as tmp:
        for batch in batches:
            # Each batch compiles as a process of its own would: dynamo keeps at most 8 graphs of one function (the
            # step's loss), and past them ran a batch eagerly under the compiled plan's name.
            torch._dynamo.reset()
            cfg = copy.deepcopy(base)
            set_key(cfg, "train.global_batch", batch)
            out = None
            if profile is not None:
                out = profile if len(batches) == 1 else profile.with_name(f"{profile.stem}-{batch}{profile.suffix}")
            yield {"bench": "throughput", "config": config,
                   **_one_batch(cfg, device, steps=steps, peak=peak, rerun=rerun, tmp=Path(tmp), profile=out)}


def _one_batch(cfg: Config, device: torch.device, *, steps: int, peak: float | None, rerun: bool, tmp: Path,
               profile: Path | None) -> dict[str, Any]:
    from raydiff.data.builtin import write_synthetic
    from raydiff.training.speed import plan_speed
    from raydiff.training.step import resolve_precision

    batch = cfg.train.global_batch
    if not cfg.data.source:  # no dataset at hand (cifar10 needs one): synthetic images of the same shape
        images = tmp / f"images-{cfg.data.resolution}-{batch}"
        write_synthetic(images, num=max(256, 2 * batch), resolution=cfg.data.resolution, fmt="png", seed=0)
        cfg.data.source = str(images)
    flops = flops_per_image(cfg, device)
    plain = [plain_loop(cfg, device, steps=steps)]
    # raydiff before the bare loop: its first start compiles with the node's compile cache as it was, not as the
    # bare loop's compilation would leave it (the bare loop's warm-up is not a figure this bench judges).
    worker_profile = None if profile is None else profile.with_name(f"{profile.stem}-worker{profile.suffix}")
    ours = raydiff_run(copy.deepcopy(cfg), steps=steps, storage=tmp / "runs", rerun=rerun, profile=worker_profile)
    described, data = ours.pop("described"), ours.pop("data")  # the worker's own start line: what its process got
    # Said at once (stderr): a bench cut later, in the loops or the profile below, still tells raydiff's figures.
    measured = {key: ours[key] for key in ("img_s", "start_s", "first_step_s", "peak_memory_gb")}
    print(f"{PARTIAL} {json.dumps({'global_batch': batch, **measured})}", file=sys.stderr, flush=True)
    bare = bare_loop(cfg, device, steps=steps)
    plain.append(plain_loop(cfg, device, steps=steps))  # bracketing raydiff's run: drift shows
    profiled = None
    if profile is not None:
        try:
            profiled = profile_step(cfg, device, steps=min(steps, 10), out=profile)
        except Exception as exc:  # noqa: BLE001 - the figures measured above stand without the profile
            print(f"bench throughput: the profile failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    if profiled is not None and profiled["device_ms_per_step"] is not None:
        # The share of raydiff's measured step the device is busy: far below 1, the host is what it waits for.
        profiled["device_busy"] = round(profiled["device_ms_per_step"] * ours["img_s"] / (1e3 * batch), 3)
    plain_img_s = round(sum(p["img_s"] for p in plain) / len(plain), 1)
    dtype = resolve_precision(cfg.train.precision, device)
    plan = plan_speed(cfg.train, device, world_size=1)
    return {
        "device": device_name(device), "torch": torch.__version__,
        "precision": {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        "global_batch": batch, "steps": steps, "flops_per_image": round(flops), "peak_tflops": peak,
        "plain": {"img_s": plain_img_s, "runs": [p["img_s"] for p in plain], **_rates(plain_img_s, flops, peak),
                  "peak_memory_gb": plain[0]["peak_memory_gb"]},
        "bare": {**bare, **_rates(bare["img_s"], flops, peak)},
        "raydiff": {**ours, **_rates(ours["img_s"], flops, peak), "profile": profiled},
        "ratio": round(ours["img_s"] / plain_img_s, 3), "ratio_bare": round(ours["img_s"] / bare["img_s"], 3),
        "options": {"compile": plan.compile, "channels_last": plan.channels_last, "cuda_graphs": plan.cuda_graphs,
                    "tf32": plan.tf32, "fused_adamw": True, "cudnn_benchmark": device.type == "cuda",
                    "ema": cfg.train.ema, "loss_weighting": cfg.train.loss_weighting, "described": described,
                    "data": data},
    }


def _rates(img_s: float, flops: float, peak: float | None) -> dict[str, Any]:
    tflops = flops * img_s / 1e12
    return {"tflops": round(tflops, 3), "mfu": round(tflops / peak, 4) if peak else None}
