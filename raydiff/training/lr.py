"""The learning rate over a run: linear warmup to the config's `train.lr` (derived by `raydiff.config.lr_rule`)."""

from __future__ import annotations


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then constant (as in DDPM)."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr
