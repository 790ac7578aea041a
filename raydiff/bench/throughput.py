"""`python -m raydiff.bench throughput`: raydiff's training against the textbook eager PyTorch loop.

Both train the config's model at its global batch and precision, on one device, in one run:
- `plain`: what a user would write by hand: eager model, AdamW (torch's default implementation), autocast,
  GradScaler for fp16, gradient clipping, one fresh batch of timesteps and noise per step; no compile. It runs
  in this process once Ray is up, so that Ray's own processes are there for both, once before raydiff's run and
  once after it (`plain_img_s_runs` shows how much the machine drifted).
- `raydiff`: the real thing, `python -m raydiff.train` through Ray Train with one worker, with its defaults for
  the device (fused AdamW, no host sync per step, compile on GPUs, ...), on images decoded by its own ingest.
  The first `steps` steps (`warmup_s`) hold start-up and compilation.

Each side's img/s is the median over MEASURED_CHUNKS chunks of its measured steps (raydiff's metrics windows), so
that a moment when the machine was busy elsewhere does not decide the ratio.

FLOPs per trained image are counted with torch's FlopCounterMode (forward + backward of the model), so
`tflops` = FLOPs x img/s, and `mfu` = tflops / the device's peak dense bf16 throughput.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

import torch

from raydiff.config import Config, load_config

MEASURED_CHUNKS = 5

# Peak dense bf16 tensor throughput (TFLOP/s) by device name; --peak-tflops for others.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0), ("RTX 4090", 165.0))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


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


class PlainLoopResult(TypedDict):
    img_s: float
    peak_memory_gb: float | None  # None off CUDA


def plain_loop(cfg: Config, device: torch.device, *, steps: int) -> PlainLoopResult:
    """The textbook loop's img/s (after `steps` warm-up steps; the median of MEASURED_CHUNKS chunks of `steps`)
    and peak memory."""
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

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(steps):
        step()
    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for chunk in _chunks(steps):
        start = time.perf_counter()
        for _ in range(chunk):
            step()
        synchronize()
        rates.append(chunk * t.global_batch / (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"img_s": statistics.median(rates), "peak_memory_gb": peak}


def _chunks(steps: int) -> list[int]:
    """`steps` split into up to MEASURED_CHUNKS near-equal chunks."""
    n = min(MEASURED_CHUNKS, steps)
    return [steps // n + (i < steps % n) for i in range(n)]


def raydiff_run(cfg: Config, *, steps: int, storage: Path) -> dict[str, Any]:
    """raydiff's own training, one worker, `steps` warm-up steps then `steps` measured ones."""
    from raydiff.config import set_key
    from raydiff.config.checks import validate
    from raydiff.training.driver import run_training

    for key, value in (("scaling.num_workers", 1), ("train.total_steps", 2 * steps),
                       ("train.log_every", _chunks(steps)[-1]),
                       ("train.checkpoint_every", 2 * steps), ("train.sample_every", 0), ("train.sample_num", 1),
                       ("train.sample_steps", 1), ("data.val_images", 0), ("run.storage", str(storage)),
                       ("run.name", "throughput"), ("train.micro_batch", None)):
        set_key(cfg, key, value)
    validate(cfg)
    summary = run_training(cfg)
    if summary["status"] != "finished":
        raise RuntimeError(f"the raydiff run ended {summary['status']}: {summary.get('error')}")
    rows = [json.loads(line) for line in (storage / "throughput" / "metrics.jsonl").read_text().splitlines()]
    warm = [row for row in rows if row["step"] <= steps][-1]
    measured = [row for row in rows if row["step"] > steps]
    peaks = [row["peak_memory_gb"] for row in measured if row.get("peak_memory_gb") is not None]
    return {"img_s": statistics.median(row["images_per_s"] for row in measured), "warmup_s": warm["time_s"],
            "peak_memory_gb": max(peaks) if peaks else None,
            "data_wait_frac": statistics.median(row["data_wait_frac"] for row in measured)}


def bench_throughput(config: str, overrides: list[str], *, steps: int, peak: float | None) -> dict[str, Any]:
    from raydiff.cluster.start import init_ray
    from raydiff.data.builtin import write_synthetic
    from raydiff.sample import resolve_device
    from raydiff.training.step import resolve_precision, speed_options

    cfg = load_config(config, overrides, check_source=False)
    device = resolve_device("auto")
    name = device_name(device)
    flops = flops_per_image(cfg, device)
    init_ray()  # the plain loop runs beside the same idle Ray processes as raydiff's worker: same conditions
    plain = [plain_loop(cfg, device, steps=steps)]
    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as tmp:
        if not cfg.data.source:  # no dataset at hand (cifar10 needs one): synthetic images of the same shape
            images = Path(tmp) / "images"
            write_synthetic(images, num=max(256, 2 * cfg.train.global_batch), resolution=cfg.data.resolution,
                            fmt="png", seed=0)
            cfg.data.source = str(images)
        ours = raydiff_run(cfg, steps=steps, storage=Path(tmp) / "runs")
    plain.append(plain_loop(cfg, device, steps=steps))  # bracketing raydiff's run: drift shows, and averages out
    plain_img_s = sum(p["img_s"] for p in plain) / len(plain)
    dtype = resolve_precision(cfg.train.precision, device)
    peak = peak or peak_tflops(name)
    tflops = flops * ours["img_s"] / 1e12
    return {
        "bench": "throughput", "config": config, "device": name, "torch": torch.__version__,
        "precision": {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        "global_batch": cfg.train.global_batch, "steps": steps,
        "plain_img_s": round(plain_img_s, 1), "plain_img_s_runs": [round(p["img_s"], 1) for p in plain],
        "raydiff_img_s": round(ours["img_s"], 1), "ratio": round(ours["img_s"] / plain_img_s, 3),
        "warmup_s": ours["warmup_s"],
        "flops_per_image": round(flops), "tflops": round(tflops, 3),
        "mfu": round(tflops / peak, 4) if peak else None, "peak_tflops": peak,
        "peak_memory_gb": ours["peak_memory_gb"], "plain_peak_memory_gb": plain[0]["peak_memory_gb"],
        "data_wait_frac": ours["data_wait_frac"],
        "options": {**speed_options(cfg.train.compile, cfg.train.channels_last, device), "fused_adamw": True,
                    "cudnn_benchmark": device.type == "cuda", "gradient_as_bucket_view": True},
    }
