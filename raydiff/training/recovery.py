"""Which checkpoint every rank restores, and what happens when training stops making finite steps: the
rollback and the divergence report.

Why a module of its own: restore and rollback must take the same decision on every rank (rank 0 chooses the
checkpoint, the others restore exactly that one), and the divergence report is what a user reads when a run
gives up; neither belongs in the loop's top-to-bottom reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray.train
import torch

from raydiff.data.loader import scaled
from raydiff.runs.errors import Unresumable
from raydiff.runs.state import (
    Progress,
    Restored,
    TrainingState,
    apply_config,
    checkpoint_candidates,
    restore_newest,
)
from raydiff.storage.errors import StorageFailure, failure_message, permanent_reason
from raydiff.storage.rundir import RunDir
from raydiff.training.distributed import from_rank_zero
from raydiff.training.step import StepResult

if TYPE_CHECKING:
    from raydiff.config import TrainSection


def restore_agreed(state: TrainingState, run_dir: RunDir, *, is_chief: bool, weight_decay: float,
                   latest: ray.train.Checkpoint | None = None) -> Restored | None:
    """Restore the newest checkpoint that loads on every worker alike. Rank 0 chooses: it lists storage (and Ray
    Train's `latest`) and tries the candidates; every other worker then restores exactly the one rank 0 restored
    (a newer one that another worker could read, say one still being written, would leave replicas that differ).
    None when there are no checkpoints; raises `Unresumable` on every worker when there are and none restores, and
    `StorageFailure` (one line) where rank 0's read met a storage error no retry can fix (permission denied): a
    restart would meet it again.
    Then the settings a re-run may change (`weight_decay`) replace the checkpoint's, at a start as after a
    rollback."""
    restored, refusal, failure = None, None, None
    if is_chief:
        try:
            restored = restore_newest(checkpoint_candidates(run_dir, latest), state)
        except Unresumable as exc:
            refusal = str(exc)
        except OSError as exc:  # a moment of the network raises on (Ray restarts the workers); this does not pass
            reason = permanent_reason(exc)
            if reason is None:
                raise
            failure = failure_message(str(run_dir), "reading the newest checkpoint", reason)
    refusal, failure, found = from_rank_zero((refusal, failure, restored and restored.checkpoint))
    if refusal:
        raise Unresumable(refusal)
    if failure:
        raise StorageFailure(failure)
    if found is not None and not is_chief:
        try:
            restored = restore_newest([found], state)
        except Unresumable as exc:  # rank 0 could restore it: a failure here is this worker's (Ray restarts)
            raise RuntimeError(str(exc)) from exc
    apply_config(state.optimizer, weight_decay=weight_decay)
    return restored


@dataclass
class Rollback:
    """Where a rollback continues, and what it skipped."""

    progress: Progress  # the restored checkpoint's, with the failed steps' stream positions skipped
    checkpoint: RunDir  # the checkpoint restored
    failed_from: int  # the first stream step of the steps that failed (they end at progress.stream_step)


def roll_back(state: TrainingState, run_dir: RunDir, progress: Progress, *, is_chief: bool,
              weight_decay: float) -> Rollback | None:
    """Back to the newest checkpoint, then on past the stream positions of the failed steps (as PaLM does): a
    replay of the same data from the same weights would fail again. The newest, a stop's or a preemption's
    included, loses the least work; the price: a run stopped after its last scheduled checkpoint rolls back to
    its stop, not where the uninterrupted run goes (documented). None when no checkpoint restores. Every
    worker calls it (a collective); rank 0 records it (`raydiff.training.cadence`)."""
    try:
        restored = restore_agreed(state, run_dir, is_chief=is_chief, weight_decay=weight_decay)
    except Unresumable:
        return None
    if restored is None:
        return None
    back = restored.progress
    failed_from = back.stream_step  # the stream positions of steps back.step+1 .. progress.step failed
    back.counters["rollbacks"] = progress.counters["rollbacks"] + 1
    back.counters["stream_offset"] += progress.step - back.step
    back.counters["skipped_steps"] = progress.counters["skipped_steps"]
    back.counters.update(bad_streak=0, longest_bad_streak=0)  # the failed steps are behind it
    return Rollback(back, restored.checkpoint, failed_from)


def divergence_report(t: TrainSection, step: int, lr: float, result: StepResult, num_timesteps: int,
                      streak: int) -> str:
    """One line that says what was going on when training diverged (`streak` non-finite steps in a row), so the
    user can act on it."""
    buckets = []
    for q in range(4):
        # The timesteps whose t * 4 // T is q, as the metrics rows' loss_q columns count them.
        low, high = -(-q * num_timesteps // 4), -(-(q + 1) * num_timesteps // 4)
        selected = result.losses.detach().float()[(result.timesteps >= low) & (result.timesteps < high)]
        mean = f"{selected.mean().item():.4g}" if len(selected) else "-"
        buckets.append(f"t {low}-{high - 1}: {mean}")
    x0 = scaled(result.images, result.images.new_zeros(len(result.images), dtype=torch.bool), flip=False)
    return (f"training diverged: {streak} non-finite steps in a row at step {step} (rolled back at most "
            f"once before); lr {lr:.3g}, grad norm {float(result.grad_norm):.3g}, input range "
            f"[{x0.min().item():.3g}, {x0.max().item():.3g}], loss by timestep ({'; '.join(buckets)}). Try a lower "
            f"train.lr, more train.warmup_steps, train.grad_clip, or train.precision=fp32/bf16.")
