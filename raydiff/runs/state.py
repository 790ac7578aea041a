"""The full training state: what a checkpoint holds, putting it back, and skipping unreadable checkpoints.

A checkpoint holds everything that is not a pure function of (config, step): weights, EMA, optimizer and
loss-scaler state, counters, and the partial sums of the current logging window. The learning rate, the sample
order and every random draw are functions of (seed, step), so restoring the step restores them exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import ray.train

from raydiff.runs.checkpoint import as_rundir, checkpoint_order, list_checkpoints, read_state
from raydiff.runs.rundir import RunDir

logger = logging.getLogger("raydiff")
REQUIRED_KEYS = ("model", "ema", "optimizer", "scaler", "step", "images_seen", "counters", "window", "config")


@dataclass
class Progress:
    """Counters that travel in checkpoints."""

    step: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"skipped_steps": 0, "rollbacks": 0})
    # Partial sums of the logging window, so a resumed run logs the same numbers as an uninterrupted one.
    window: dict[str, Any] = field(default_factory=lambda: {"loss_sum": 0.0, "samples": 0, "grad_norm_sum": 0.0,
                                                            "finite_steps": 0})


def training_state(model, ema, optimizer, scaler, progress: Progress, global_batch: int,
                   config: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "step": progress.step, "images_seen": progress.step * global_batch,
        "counters": dict(progress.counters), "window": dict(progress.window), "config": config,
    }


def restore(state: dict[str, Any], model, ema, optimizer, scaler) -> Progress:
    """Load `state` into the objects (raises if it does not fit them) and return its progress."""
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise KeyError(f"missing {', '.join(missing)}")
    model.load_state_dict(state["model"])
    ema.load_state_dict(state["ema"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    return Progress(step=state["step"], counters=dict(state["counters"]), window=dict(state["window"]))


def restore_newest(candidates: list[RunDir], model, ema, optimizer, scaler) -> tuple[Progress, RunDir | None]:
    """Restore the first candidate checkpoint that reads and fits, warning about each one skipped."""
    for path in candidates:
        try:
            return restore(read_state(path), model, ema, optimizer, scaler), path
        except Exception as exc:  # a truncated file, a missing key, a shape mismatch: try the previous one
            logger.warning(f"[raydiff] WARNING: checkpoint {path} is unreadable ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200]}); falling back to the previous one")
    if candidates:
        logger.warning("[raydiff] WARNING: no readable checkpoint left; starting from scratch")
    return Progress(), None


def checkpoint_candidates(run_dir: RunDir, latest: ray.train.Checkpoint | None = None) -> list[RunDir]:
    """Checkpoints to restore, newest first: every checkpoint of the run on storage, plus Ray Train's latest.

    Storage can be ahead of Ray's bookkeeping: a checkpoint uploaded just before a crash may never have
    reached the controller. It is complete (or fails to load and is skipped), so it is used.
    """
    run_dir = as_rundir(run_dir)
    found = set(list_checkpoints(run_dir))
    if latest is not None:  # Ray's checkpoints live in the run directory, on the same storage
        found.add(run_dir / PurePosixPath(latest.path).name)
    return sorted(found, key=checkpoint_order, reverse=True)
