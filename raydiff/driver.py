"""The driver: start or join Ray, decode the data once, plan resources, run the TorchTrainer, write the summary."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import yaml
from ray.train.torch import TorchTrainer

from raydiff.config import Config
from raydiff.ingest import load_images
from raydiff.loop import train_worker
from raydiff.runlog import MetricsLog


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS or started on this machine (`ray start`), else start a local one."""
    if ray.is_initialized():
        return
    ray.init(logging_level=logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # raydiff prints its own one-line data summary
    ray.data.DataContext.get_current().enable_progress_bars = os.isatty(2)


def plan_scaling(cfg: Config) -> tuple[ray.train.ScalingConfig, int]:
    """Workers, devices and CPUs per worker; returns Ray's ScalingConfig and torch threads per worker.

    Ray Data decodes the whole dataset before training starts (see `raydiff.ingest`), so training may use
    every CPU without starving the data pipeline: the two never compete, and nothing can deadlock.
    """
    s = cfg.scaling
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 1)
    use_gpu = gpus > 0 if s.use_gpu == "auto" else s.use_gpu
    if use_gpu and gpus == 0:
        print("[raydiff] scaling.use_gpu is true but the cluster has no GPU now: waiting for one to be added")
    if s.cpus_per_worker is not None:
        cpus_per_worker = s.cpus_per_worker
    elif use_gpu:
        cpus_per_worker = 1.0
    else:
        cpus_per_worker = max(cpus // s.num_workers, min(1.0, cpus / s.num_workers))
    scaling = ray.train.ScalingConfig(
        num_workers=s.num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus_per_worker},
    )
    return scaling, max(1, math.floor(cpus_per_worker))


def _write_yaml(path: Path, tree: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(tree, sort_keys=False))
    os.replace(tmp, path)


def _write_json(path: Path, tree: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(tree, indent=2) + "\n")
    os.replace(tmp, path)


def run_training(cfg: Config) -> dict[str, Any]:
    """Train to `cfg.train.total_steps` (resuming the run's latest checkpoint) and return the summary."""
    started = time.perf_counter()
    run_dir = Path(cfg.run.storage) / cfg.run.name

    # Decode the data once with Ray Data; a bad source fails here, before anything is written.
    init_ray()
    decode_start = time.perf_counter()
    images = load_images(cfg.data.source, resolution=cfg.data.resolution, channels=cfg.data.channels)
    scaling, torch_threads = plan_scaling(cfg)
    print(f"[raydiff] decoded {images.num_images} images from {images.source} at {cfg.data.resolution}px in "
          f"{time.perf_counter() - decode_start:.1f} s; training on {scaling.num_workers} "
          f"{'GPU' if scaling.use_gpu else 'CPU'} worker(s); run directory {run_dir}")

    # Record the resolved config next to the results.
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_yaml(run_dir / "config.yaml", cfg.to_dict())

    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"config": cfg.to_dict(), "images": images, "run_dir": str(run_dir),
                           "torch_threads": torch_threads},
        scaling_config=scaling,
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage,
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    error = None
    try:
        result = trainer.fit()
        outcome = result.return_value or {}
        checkpoint = result.checkpoint.path if result.checkpoint else None
    except ray.train.TrainingFailedError as exc:
        error, outcome, checkpoint = str(exc).strip().splitlines()[0], {}, None

    # Summarise from the worker's return value and the metrics log.
    rows = MetricsLog(run_dir / "metrics.jsonl").rows()
    world_sizes = list(dict.fromkeys(r["world_size"] for r in rows))
    finished = error is None and outcome.get("steps") == cfg.train.total_steps
    summary = {
        "status": "finished" if finished else "failed",
        "steps": outcome.get("steps", rows[-1]["step"] if rows else 0),
        "images_seen": outcome.get("images_seen", rows[-1]["images_seen"] if rows else 0),
        "final_loss": outcome.get("final_loss", rows[-1]["loss"] if rows else None),
        "skipped_steps": outcome.get("skipped_steps", rows[-1]["skipped_steps"] if rows else 0),
        "checkpoint": checkpoint,
        "world_sizes": world_sizes,
        "wall_s": round(time.perf_counter() - started, 1),
        "run_dir": str(run_dir),
    }
    if error:
        summary["error"] = error
    _write_json(run_dir / "summary.json", summary)
    return summary
