"""The statistics of one logging window (the steps between two metrics rows), and the row they make.

The loss and sample sums are per worker until the row is made (one all-reduce per row, not per step). A
checkpoint in the middle of a window saves their global sums, and a resumed run puts them back on rank 0 only,
so that the row after a resume is the one an uninterrupted run logs, whatever the world size.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from raydiff.cluster.devices import synchronize
from raydiff.training.distributed import summed
from raydiff.training.step import StepResult


class MetricsWindow:
    """:param saved: the window of the checkpoint the run continues from (`Progress.window`), or None.
    :param is_chief: rank 0 takes the saved loss and sample sums; the other workers start from zero."""

    def __init__(self, device: torch.device, saved: dict[str, Any] | None = None, is_chief: bool = True) -> None:
        self.device = device
        self._open(saved or {}, is_chief)

    def _open(self, saved: dict[str, Any], is_chief: bool) -> None:
        own = is_chief and saved
        device = self.device
        # float64: the sum of float32 losses is then exact, so a window split by a resume sums to the same number.
        self.loss_sum = torch.tensor(float(saved["loss_sum"]) if own else 0.0, dtype=torch.float64, device=device)
        self.samples = torch.tensor(int(saved["samples"]) if own else 0, dtype=torch.long, device=device)
        # Gradient norms are global (the gradients are all-reduced): every worker holds the same sums.
        self.grad_norm_sum = torch.tensor(float(saved.get("grad_norm_sum", 0.0)), dtype=torch.float64, device=device)
        self.finite_steps = torch.tensor(int(saved.get("finite_steps", 0)), device=device)
        # Loss sums and sample counts per timestep quarter, like loss_sum (global in a checkpoint, on rank 0).
        self.quarter_sums = torch.tensor(saved.get("quarter_sums", [[0.0] * 4] * 2) if own else [[0.0] * 4] * 2,
                                         dtype=torch.float64, device=device)
        self.steps, self.data_wait_s, self.paused_s = 0, 0.0, 0.0
        self.start = time.perf_counter()

    def add(self, result: StepResult, data_wait_s: float) -> None:
        """On the device: no host sync. A skipped (non-finite) step's samples were not trained on: its losses, NaN
        or not, are left out of the row's loss, as its gradient norm is of the row's."""
        self.loss_sum += torch.where(result.finite, result.loss_sum.double(), 0.0)
        self.quarter_sums += torch.where(result.finite, result.quarter_sums.double(), 0.0)
        self.samples += result.finite.long() * result.samples
        self.grad_norm_sum += torch.where(result.finite, result.grad_norm.double(), 0.0)
        self.finite_steps += result.finite
        self.steps += 1
        self.data_wait_s += data_wait_s

    def checkpoint_state(self) -> dict[str, Any]:
        """The window's sums over all workers, for the checkpoint (a collective: every worker calls it)."""
        loss_sum, samples, *quarters = summed([float(self.loss_sum), float(self.samples),
                                               *self.quarter_sums.flatten().tolist()], self.device)
        return {"loss_sum": loss_sum, "samples": int(samples), "grad_norm_sum": float(self.grad_norm_sum),
                "finite_steps": int(self.finite_steps), "quarter_sums": [quarters[:4], quarters[4:]]}

    def close(self, *, step: int, global_batch: int, lr: float, ema_decay: float, world_size: int,
              skipped_steps: int) -> dict[str, Any]:
        """One metrics row, averaged over all workers (a collective); the window starts afresh."""
        # The window's time ends when its steps are done on the device, not when the host has issued them: a GPU
        # runs several steps behind, and those would otherwise count in no window.
        synchronize(self.device)
        elapsed = time.perf_counter() - self.start - self.paused_s
        loss_sum, samples, wait_frac_sum, *quarters = summed(
            [float(self.loss_sum), float(self.samples), self.data_wait_s / max(elapsed, 1e-9),
             *self.quarter_sums.flatten().tolist()], self.device)
        finite_steps = int(self.finite_steps)
        row = {
            "step": step,
            "images_seen": step * global_batch,
            "loss": loss_sum / samples if samples else float("nan"),  # NaN (null): every step skipped
            "grad_norm": float(self.grad_norm_sum) / finite_steps if finite_steps else float("nan"),
            "lr": lr,
            "ema_decay": ema_decay,
            "images_per_s": self.steps * global_batch / max(elapsed, 1e-9),
            "data_wait_frac": wait_frac_sum / world_size,
            "world_size": world_size,
            "skipped_steps": skipped_steps,
            # The loss per timestep quarter: q1 = t in [0, T/4) (fine detail) ... q4 (coarse layout).
            **{f"loss_q{q + 1}": quarters[q] / quarters[4 + q] if quarters[4 + q] else None for q in range(4)},
        }
        self._open({}, is_chief=True)  # the next window starts from zero
        return row


class NonFiniteSteps:
    """Counts skipped (non-finite) steps and the longest run of them in a row, on the device; read only at the
    periodic checks, so that the step itself never waits for the device.

    :param counters: the checkpoint's (`Progress.counters`): the count so far, and the run of non-finite steps
        going on at the checkpoint and the longest since the last check, so that a resumed run rolls back where
        an uninterrupted one does.
    """

    def __init__(self, device: torch.device, counters: dict[str, int] | None = None) -> None:
        counters = counters or {}
        self.skipped = torch.tensor(counters.get("skipped_steps", 0), device=device)
        self.streak = torch.tensor(counters.get("bad_streak", 0), dtype=torch.long, device=device)
        # Since the last `longest_streak()`.
        self.longest = torch.tensor(counters.get("longest_bad_streak", 0), dtype=torch.long, device=device)

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the counter (reads the device)."""
        return {"skipped_steps": int(self.skipped), "bad_streak": int(self.streak),
                "longest_bad_streak": int(self.longest)}

    def add(self, finite: torch.Tensor) -> None:
        bad = (~finite).long()
        self.skipped += bad
        self.streak = (self.streak + 1) * bad
        self.longest = torch.maximum(self.longest, self.streak)

    def skipped_steps(self) -> int:
        return int(self.skipped)

    def longest_streak(self) -> int:
        """The longest run of non-finite steps since the last call."""
        longest = int(self.longest)
        self.longest = self.streak.clone()
        return longest
